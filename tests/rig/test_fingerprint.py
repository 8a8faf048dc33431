"""The rig's fingerprint and re-validation on change (rigup/rig/servingctl.py, issue 43): what the script's
output parses to, how a change is named, and `revalidate` on a rig in a temporary directory: unchanged does
nothing, none recorded records today's, a change removes vLLM's P2P access cache, restarts the pod and gates
it with every probe (no rollback), recording the new fingerprint only when the gate passed."""

from __future__ import annotations

import json

from rigup.rig import servingctl as ctl
from tests.rig.test_servingctl import FINGERPRINT, MODEL, FakeDocker, rig, run_gate, server, systemd  # noqa: F401

# nvidia-smi 580's own output on a 2x RTX 3090 rig (the bus ids with 8-digit domains, the topology header
# underlined with ANSI codes, the affinity columns after the GPU columns), as the script runs it
SMI_OUTPUT = f"""\
0, GPU-1b6f0d3e-5a2c-4f7e-9d1a-0c3b2e4f5a6b, 00000000:01:00.0, 580.95.05, 94.02.42.00.A9
1, GPU-7c2e9a41-0b3d-4e8f-a1c2-d3e4f5a6b7c8, 00000000:02:00.0, 580.95.05, 94.02.42.00.A9
{ctl.FINGERPRINT_MARK}
\t\x1b[4mGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m
GPU0\t X \tPIX\t0-15\t0\t\tN/A
GPU1\tPIX\t X \t0-15\t0\t\tN/A

Legend:

  X    = Self
  PIX  = Connection traversing at most a single PCIe bridge
{ctl.FINGERPRINT_MARK}
 \tGPU0\tGPU1\t
 GPU0\tX\tNS\t
 GPU1\tNS\tX\t

Legend:

  X    = Self
  OK   = Status Ok
{ctl.FINGERPRINT_MARK}
NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build  (dvs-builder@U22-I3-AF03-09-1)  Thu Sep 25 00:00:00 UTC 2025
{ctl.FINGERPRINT_MARK}
6.8.0-45-generic
{ctl.FINGERPRINT_MARK}
F20
"""


def test_the_scripts_output_parses_to_the_rigs_parts():
    assert ctl.parse_fingerprint(SMI_OUTPUT.splitlines()) == {
        "driver": "580.95.05",
        "gpu0.uuid": "GPU-1b6f0d3e-5a2c-4f7e-9d1a-0c3b2e4f5a6b", "gpu0.pci": "00000000:01:00.0",
        "gpu0.vbios": "94.02.42.00.A9",
        "gpu1.uuid": "GPU-7c2e9a41-0b3d-4e8f-a1c2-d3e4f5a6b7c8", "gpu1.pci": "00000000:02:00.0",
        "gpu1.vbios": "94.02.42.00.A9",
        "topology": "GPU0 X PIX; GPU1 PIX X",  # the GPU columns only: affinity and legend left out
        "p2p": "GPU0 X NS; GPU1 NS X",
        "module": "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64 580.95.05 Release Build "
                  "(dvs-builder@U22-I3-AF03-09-1) Thu Sep 25 00:00:00 UTC 2025",
        "kernel": "6.8.0-45-generic",
        "bios": "F20",
    }


def test_a_rig_without_a_driver_or_dmi_reads_as_none_not_as_garbage():
    broken = [
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the latest "
        "NVIDIA driver is installed and running.", ctl.FINGERPRINT_MARK,
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.", ctl.FINGERPRINT_MARK,
        ctl.FINGERPRINT_MARK, ctl.FINGERPRINT_MARK, "6.8.0-45-generic", ctl.FINGERPRINT_MARK,
    ]
    assert ctl.parse_fingerprint(broken) == {"driver": None, "topology": None, "p2p": None, "module": None,
                                             "kernel": "6.8.0-45-generic", "bios": None}
    assert ctl.parse_fingerprint([])["kernel"] is None


def test_a_change_is_named_part_by_part():
    before = ctl.parse_fingerprint(SMI_OUTPUT.splitlines())
    after = ctl.parse_fingerprint(SMI_OUTPUT.replace("580.95.05", "580.105.08")
                                  .replace("GPU-7c2e9a41-0b3d-4e8f-a1c2-d3e4f5a6b7c8", "GPU-99999999-0000-4000-8000-000000000001")
                                  .splitlines())
    assert ctl.fingerprint_changes(before, before) == []
    assert ctl.fingerprint_changes(before, after) == [
        "driver 580.95.05 to 580.105.08",
        "NVIDIA module NVRM version: NVIDIA UNIX Open Kernel Module for x86_64 580.95.05 Release Build "
        "(dvs-builder@U22-I3-AF03-09-1) Thu Sep 25 00:00:00 UTC 2025 to NVRM version: NVIDIA UNIX Open Kernel "
        "Module for x86_64 580.105.08 Release Build (dvs-builder@U22-I3-AF03-09-1) Thu Sep 25 00:00:00 UTC 2025",
        "GPU1 UUID GPU-7c2e9a41-0b3d-4e8f-a1c2-d3e4f5a6b7c8 to GPU-99999999-0000-4000-8000-000000000001",
    ]
    one_gpu = {k: v for k, v in before.items() if not k.startswith("gpu1.")}
    assert ctl.fingerprint_changes(before, one_gpu) == [
        "GPU1 PCI bus id 00000000:02:00.0 to none", "GPU1 UUID GPU-7c2e9a41-0b3d-4e8f-a1c2-d3e4f5a6b7c8 to none",
        "GPU1 VBIOS 94.02.42.00.A9 to none",
    ]


def test_the_script_runs_on_this_machine():
    """The script is plain sh: on a machine without nvidia-smi the GPU parts are None and the kernel is read."""
    fingerprint = ctl.rig_fingerprint()
    assert fingerprint["kernel"] and set(fingerprint) >= {"driver", "topology", "p2p", "module", "kernel", "bios"}


# --------------------------------------------------------------------------------------------
# revalidate


def revalidate(release, systemd, fingerprint):  # noqa: F811
    lines: list[str] = []
    code = ctl.revalidate(str(release), 5.0, 2, systemd, out=lines.append, fingerprint=fingerprint, poll_s=0.01,
                          docker=FakeDocker())
    return code, lines


def test_an_unchanged_fingerprint_restarts_nothing(rig, systemd, server):  # noqa: F811
    release = rig.deploy("dual", MODEL)
    assert run_gate(release, systemd)[0] == ctl.EXIT_PASSED
    assert rig.provenance["fingerprint"] == FINGERPRINT
    before = len(server.behaviour.completions)
    code, lines = revalidate(release, systemd, dict(FINGERPRINT))
    assert code == ctl.EXIT_PASSED and lines == [f"{ctl.REVALIDATED_MARKER} fingerprint unchanged"]
    assert ("restart", "rigup-dual.service") not in systemd.calls and len(server.behaviour.completions) == before


def test_a_record_from_before_the_fingerprint_gets_todays_without_a_restart(rig, systemd, server):  # noqa: F811
    release = rig.deploy("dual", MODEL)
    run_gate(release, systemd)
    path = rig.install_root / "state/provenance.json"
    record = json.loads(path.read_text())
    del record["fingerprint"]
    path.write_text(json.dumps(record))
    code, lines = revalidate(release, systemd, dict(FINGERPRINT))
    assert code == ctl.EXIT_PASSED
    assert lines == [f"{ctl.REVALIDATED_MARKER} fingerprint recorded (the last gate predates the record)"]
    assert rig.provenance["fingerprint"] == FINGERPRINT and rig.provenance["generation"] == 1
    assert ("restart", "rigup-dual.service") not in systemd.calls


def test_a_changed_fingerprint_removes_the_p2p_cache_restarts_and_runs_every_probe(rig, systemd, server, tmp_path):  # noqa: F811
    release = rig.deploy("dual", MODEL)
    # a pod whose compose mounts the container's VLLM_CACHE_ROOT keeps vLLM's P2P verdict on the host
    cache = tmp_path / "opt/rigup/cache/dual/vllm"
    cache.mkdir(parents=True)
    (cache / "gpu_p2p_access_cache_for_0,1.json").write_text('{"0->1": true, "1->0": true}')
    (cache / "torch_compile_cache").mkdir()
    data = json.loads(release.read_text())
    data["p2p_cache_dirs"] = [str(cache)]
    release.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    run_gate(release, systemd)
    flashed = {**FINGERPRINT, "gpu0.vbios": "94.02.42.00.B1"}
    before = len(server.behaviour.completions)
    code, lines = revalidate(release, systemd, flashed)
    assert code == ctl.EXIT_PASSED, lines
    assert lines[0] == "rigup: rigup-dual.service: fingerprint changed: GPU0 VBIOS 94.02.42.00.A9 to 94.02.42.00.B1"
    assert lines[1] == f"rigup: removed vLLM's P2P access cache {cache}/gpu_p2p_access_cache_for_0,1.json"
    assert lines[-1] == (
        f"{ctl.REVALIDATED_MARKER} fingerprint changed: GPU0 VBIOS 94.02.42.00.A9 to 94.02.42.00.B1 -> P2P cache removed "
        "(1 file(s) on the host, and the container's with compose down), full probe set passed "
        "(4 probes: arithmetic, recall, tool-call, json-shape)")
    assert sorted(p.name for p in cache.iterdir()) == ["torch_compile_cache"]  # the P2P verdict only
    assert ("restart", "rigup-dual.service") in systemd.calls
    # the readiness completion, then every probe of the release
    asked = [c["messages"] for c in server.behaviour.completions[before + 1:]]
    assert asked == [ctl.PROBES[name].messages for name in ctl.PROBE_NAMES]
    prov = rig.provenance
    assert prov["fingerprint"] == flashed and prov["generation"] == 1 and prov["gate"]["result"] == "passed"
    # the next converge finds it unchanged
    assert revalidate(release, systemd, flashed)[1] == [f"{ctl.REVALIDATED_MARKER} fingerprint unchanged"]


def test_a_changed_rig_that_answers_garbage_fails_without_rollback_and_keeps_the_old_fingerprint(rig, systemd, server):  # noqa: F811
    release = rig.deploy("dual", MODEL)
    run_gate(release, systemd)
    server.behaviour.garbage = True
    systemd.restart = lambda unit: systemd.calls.append(("restart", unit))  # the rig's fault outlives the restart
    new_driver = {**FINGERPRINT, "driver": "580.105.08"}
    code, lines = revalidate(release, systemd, new_driver)
    assert code == ctl.EXIT_FAILED
    assert any("probe arithmetic failed: lexical variety 0.00" in line for line in lines), lines
    assert "rigup: not rolling back: rollback disabled" in lines
    assert lines[-1].startswith(f"{ctl.REVALIDATED_MARKER} fingerprint changed: driver 580.95.05 to 580.105.08 -> "
                                "P2P cache removed (the container's, with compose down: none is kept on the host), "
                                "full probe set FAILED")
    assert rig.provenance["fingerprint"] == FINGERPRINT  # the next converge re-validates again


def test_revalidate_refuses_a_release_that_did_not_pass_here(rig, systemd, server):  # noqa: F811
    release = rig.deploy("dual", MODEL)
    code, lines = revalidate(release, systemd, dict(FINGERPRINT))
    assert code == ctl.EXIT_FAILED and "gate it first" in lines[0]


# --------------------------------------------------------------------------------------------
# revalidate --member: a cluster member, whose cluster gates as one (rigup.operations.cluster_gate)


def revalidate_member(release, systemd, fingerprint):  # noqa: F811
    lines: list[str] = []
    code = ctl.revalidate(str(release), 5.0, 2, systemd, out=lines.append, fingerprint=fingerprint, poll_s=0.01,
                          docker=FakeDocker(), member=True)
    return code, lines


def with_host_p2p_cache(release, tmp_path):
    """The pod's release names a host directory where vLLM keeps its P2P verdict; returns the verdict's file."""
    cache = tmp_path / "opt/rigup/cache/big/vllm"
    cache.mkdir(parents=True)
    verdict = cache / "gpu_p2p_access_cache_for_0,1.json"
    verdict.write_text('{"0->1": true, "1->0": true}')
    data = json.loads(release.read_text())
    data["p2p_cache_dirs"] = [str(cache)]
    release.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return verdict


def test_a_changed_member_loses_its_p2p_cache_and_restarts_and_its_clusters_gate_records_the_new_fingerprint(
        rig, systemd, server, tmp_path):  # noqa: F811
    release = rig.deploy("dual", MODEL)
    verdict = with_host_p2p_cache(release, tmp_path)
    run_gate(release, systemd)
    flashed = {**FINGERPRINT, "gpu0.uuid": "GPU-replaced"}
    before = len(server.behaviour.completions)
    code, lines = revalidate_member(release, systemd, flashed)
    assert code == ctl.EXIT_PASSED, lines
    assert lines[0].startswith("rigup: rigup-dual.service: fingerprint changed: GPU0 UUID ")
    assert lines[1] == f"rigup: removed vLLM's P2P access cache {verdict}"
    assert lines[-1].startswith(f"{ctl.REVALIDATED_MARKER} fingerprint changed: GPU0 UUID ")
    assert lines[-1].endswith("-> P2P cache removed (1 file(s) on the host, and the container's with compose down), "
                              "member restarted: the cluster's gate asks the full probe set (4 probes: arithmetic, "
                              "recall, tool-call, json-shape)")
    assert not verdict.exists() and ("restart", "rigup-dual.service") in systemd.calls
    # gated by its cluster, not alone: nothing asked, nothing recorded yet
    assert len(server.behaviour.completions) == before and rig.provenance["fingerprint"] == FINGERPRINT
    # the cluster's gate: the held gate asks every probe and records nothing, then every member's gate records
    held: list[str] = []
    assert ctl.gate(str(release), 5.0, 2, True, systemd, out=held.append, poll_s=0.01, docker=FakeDocker(),
                    hold=True, fingerprint=flashed) == ctl.EXIT_PASSED
    asked = [c["messages"] for c in server.behaviour.completions[before + 1:]]
    assert asked == [ctl.PROBES[name].messages for name in ctl.PROBE_NAMES]
    assert rig.provenance["fingerprint"] == FINGERPRINT
    assert ctl.gate(str(release), 5.0, 2, True, systemd, out=held.append, poll_s=0.01, docker=FakeDocker(),
                    fingerprint=flashed) == ctl.EXIT_PASSED
    assert rig.provenance["fingerprint"] == flashed and rig.provenance["generation"] == 1
    assert revalidate_member(release, systemd, flashed)[1] == [f"{ctl.REVALIDATED_MARKER} fingerprint unchanged"]


def test_a_member_whose_cluster_gate_fails_keeps_the_old_fingerprint_and_has_nothing_older_to_roll_back_to(
        rig, systemd, server):  # noqa: F811
    release = rig.deploy("dual", MODEL)
    run_gate(release, systemd)
    new_driver = {**FINGERPRINT, "driver": "580.105.08"}
    assert revalidate_member(release, systemd, new_driver)[0] == ctl.EXIT_PASSED
    server.behaviour.garbage = True
    systemd.restart = lambda unit: systemd.calls.append(("restart", unit))  # the rig's fault outlives a restart
    held: list[str] = []
    assert ctl.gate(str(release), 5.0, 2, True, systemd, out=held.append, poll_s=0.01, docker=FakeDocker(),
                    hold=True, fingerprint=new_driver) == ctl.EXIT_FAILED
    assert any("probe arithmetic failed: lexical variety 0.00" in line for line in held), held
    # the cluster rolls back as one: this member's release is its last good one, so nothing is restored
    back: list[str] = []
    assert ctl.roll_back(str(release), "cluster big rolls back as one: rig-01: probe arithmetic failed", 5.0, systemd,
                         out=back.append, poll_s=0.01) == ctl.EXIT_FAILED
    assert "rigup: not rolling back: the failing release is the last good one (generation 1): nothing older to restore" \
        in back, back
    assert rig.provenance["fingerprint"] == FINGERPRINT  # the next converge re-validates again
    assert revalidate_member(release, systemd, new_driver)[1][-1].startswith(
        f"{ctl.REVALIDATED_MARKER} fingerprint changed: driver 580.95.05 to 580.105.08")


def test_a_member_rolling_out_another_release_loses_its_cache_and_leaves_the_restart_to_the_new_release(
        rig, systemd, server, tmp_path):  # noqa: F811
    release = rig.deploy("dual", MODEL)
    verdict = with_host_p2p_cache(release, tmp_path)
    run_gate(release, systemd)
    data = json.loads(release.read_text())
    data["description"] = "the next release, written by this converge"
    release.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    code, lines = revalidate_member(release, systemd, {**FINGERPRINT, "kernel": "6.8.0-50-generic"})
    assert code == ctl.EXIT_PASSED and not verdict.exists()
    assert lines[-1].endswith("-> P2P cache removed (1 file(s) on the host, and the container's with compose down); "
                              "the new release's restart and the cluster's gate follow (4 probes: arithmetic, recall, "
                              "tool-call, json-shape)")
    assert ("restart", "rigup-dual.service") not in systemd.calls


def test_a_member_record_from_before_the_fingerprint_gets_todays_without_a_restart(rig, systemd, server):  # noqa: F811
    release = rig.deploy("dual", MODEL)
    run_gate(release, systemd)
    path = rig.install_root / "state/provenance.json"
    record = json.loads(path.read_text())
    del record["fingerprint"]
    path.write_text(json.dumps(record))
    assert revalidate_member(release, systemd, dict(FINGERPRINT))[1] == [
        f"{ctl.REVALIDATED_MARKER} fingerprint recorded (the last gate predates the record)"]
    assert rig.provenance["fingerprint"] == FINGERPRINT and ("restart", "rigup-dual.service") not in systemd.calls
