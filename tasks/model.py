"""Model: the variant's model (and draft) files on the rig (every pod's), each verified against the locked SHA-256.

True afterwards: every file the lock lists for the variant's models (weights, configs, tokenizers)
is in {model_dir}/<dir> (e.g. qwen3.6-27b-autoround-int4, qwen3.6-27b-dflash) with the locked
SHA-256, and stamped in {install_root}/state/model-stamps.json. A re-run with an unchanged lock
reads stamps only (nothing hashed or downloaded); --data model_reverify=true hashes everything.
Progress: tail -f {install_root}/state/fetch.log on the rig.
Reads: variant, install_root, model_dir, lock_file, hf_endpoint, hf_token_file (or env HF_TOKEN on
the control machine), model_reverify, model_download_retries, model_fleet_source, model_fleet_port,
model_fleet_address, preflight_disk_margin_gb.
Restarts: nothing (serving restarts when the model revision in its provenance changes).
Not idempotent: none. In fleet mode the rigs holding a model form a chain, ordered at execution (rigs
that have the files first): the head reads the hub, each other rig its nearest upstream, and every rig
forwards each piece once it is verified, so the hub serves one copy and every link carries it once.
A rig serves only while a rig after it in a chain needs files.
Without a usable lock: a real run stops here (when sources did not already; pyinfra ends the run when a task file raises), saying what
the lock pins and how to make it; a --dry run warns so in one line and plans nothing here.
"""

from pyinfra import host, state
from pyinfra.operations import files

from rigup.desired.knobs import knob
from rigup.operations.apt import os_packages
from rigup.operations.model import model_files, rigfetch_upload
from rigup.operations.planning_errors import model_plan_or_stop

plan = model_plan_or_stop(state, host)  # None: the lock lacks the model pins (--dry warns)

if plan is not None:
    reverify = bool(knob(host.data, "model_reverify"))
    retries = knob(host.data, "model_download_retries")
    token_file = knob(host.data, "hf_token_file")

    os_packages(name="Install python3 for rigfetch", packages=["python3"])
    files.directory(name="Create the rigup bin directory", path=plan.script.rsplit("/", 1)[0], mode="755")
    files.put(name="Upload rigfetch (model fetch and verify helper)", src=rigfetch_upload(), dest=plan.script, mode="755")

    model_files(
        name="Fetch locked model files (fleet: one rig reads the hub, the others forward verified pieces)",
        manifest=plan.manifest,
        script=plan.script,
        chains=plan.chains,
        listen_port=plan.listen_port,
        reverify=reverify,
        retries=retries,
        hf_token_file=token_file,
    )
