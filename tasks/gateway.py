"""Gateway: on the hosts of gateway_group, one OpenAI endpoint over what the fleet's rigs serve.

True afterwards: {install_root}/gateway/venv-<hash>/ holds LiteLLM's proxy installed from the
hash-pinned files/gateway/requirements.txt (pip --require-hashes, from gateway_pip_index_url);
{install_root}/gateway/gateway.env (0600, root; the only place the gateway key and the rigs' API keys
are written); {install_root}/gateway/config.yaml has one route per rig and served model, from each
rig's provenance record (the release that last passed the health gate) and its running unit, read
after every rig's serving phase in this run (a rig outside the run is connected to for that read; one
that cannot be reached or read keeps the routes it had); LiteLLM checks
each route every gateway_health_check_interval_s and keeps failing ones out of rotation, and retries a
failed request on another rig of the same model; rigup-gateway.service runs it on
gateway_bind_address:gateway_port, at boot too, and answers /health/readiness.
Reads: gateway_group, gateway_bind_address, gateway_port, gateway_api_key_file, gateway_pip_index_url,
gateway_health_check_interval_s, gateway_num_retries, gateway_ready_timeout_s, install_root, and every
rig's serving_api_key_file, ssh_hostname and install_root.
Restarts: rigup-gateway.service when its venv, environment file, config or unit changed after it
started (judged on the host, so an interrupted run is finished by the next); then removes the venvs
of earlier pins.
Not idempotent: "Wait for the gateway to answer" runs only after such a restart.
Included by deploy.py on gateway_group hosts that passed preflight only.
"""

from io import StringIO

from pyinfra import host, state
from pyinfra.api.hiddenvalue import HiddenValue
from pyinfra.operations import apt, files

from rigup.desired.gateway import (
    REQUIREMENTS_FILE,
    UNIT_FILE,
    UNIT_NAME,
    GatewayError,
    requirements_sha256,
    unit_text,
)
from rigup.desired.knobs import KnobError
from rigup.desired.secrets import SecretError
from rigup.operations.gateway import gateway_config, gateway_venv, other_venvs_removed
from rigup.operations.planning_errors import stop_the_run_on
from rigup.operations.serving import secret_file
from rigup.operations.units import answers_http, unit_runs_current_files
from rigup.runstate import fleet_plan

with stop_the_run_on(host, GatewayError, SecretError, KnobError):
    plan = fleet_plan(state).host(host.name).gateway()  # routes to every rig of the fleet
assert plan is not None  # deploy.py includes this file on gateway_group hosts only
paths = plan.paths
apt.packages(name="Install python3-venv and curl for the gateway", packages=["python3-venv", "curl"])
files.directory(name="Create the gateway directory", path=paths.root, mode="755")
files.put(
    name="Upload the gateway's hash-pinned requirements",
    src=str(REQUIREMENTS_FILE),
    dest=paths.requirements_file,
    mode="644",
)
gateway_venv(
    name="Build the gateway venv (LiteLLM proxy, pinned)",
    venv=paths.venv,
    requirements=paths.requirements_file,
    requirements_sha256=requirements_sha256(),
    index_url=plan.pip_index_url,
)
secret_file(
    name="Write the gateway environment file (0600: its key and the rigs' keys)",
    path=paths.env_file,
    content=HiddenValue(plan.env_text),
)
gateway_config(
    name="Write the gateway routes from what each rig serves now",
    path=paths.config_file,
    rigs=plan.rigs,
    install_roots=plan.install_roots,
    health_check_interval_s=plan.health_check_interval_s,
    num_retries=plan.num_retries,
)
files.put(
    name="Write the gateway's systemd unit",
    src=StringIO(unit_text(paths, bind_address=plan.bind_address, port=plan.port)),
    dest=UNIT_FILE,
    mode="644",
)
service = unit_runs_current_files(
    name="Run the gateway on its current venv, keys, routes and unit (restart only on a change)",
    unit=UNIT_NAME,
    files=[f"{paths.venv}/.rigup-installed", paths.env_file, paths.config_file, UNIT_FILE],
)
answers_http(
    name="Wait for the gateway to answer",
    url=plan.readiness_url,
    timeout_s=plan.ready_timeout_s,
    unit=UNIT_NAME,
    what="gateway",
    _if=service.did_change,
)
other_venvs_removed(name="Remove the venvs of earlier gateway pins", root=paths.root, keep=paths.venv)
