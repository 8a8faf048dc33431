"""Entrance: on the hosts of gateway_group, the fleet's one OpenAI endpoint over what the rigs serve (issue 44).

True afterwards: nginx and its njs module from the OS archive front the fleet on gateway_bind_address:gateway_port
over TLS with a certificate the fleet CA issued (or renewed) in this run for the host's names, or
gateway_tls_cert_file/_key_file's ({install_root}/gateway/tls.crt, tls.key 0600, tls-ca.crt: the CA its clients trust;
plain HTTP only with gateway_plain_http); /etc/nginx/conf.d/rigup-entrance.conf allows only the OpenAI paths
(rigup.desired.entrance.ALLOWED_PATHS) and refuses the rest with 404, a request without a client's key with 401;
{install_root}/gateway/clients.map (0600, root) holds the clients' keys (gateway_clients, and gateway_api_key_file's
as client "default"), pod-key.conf (0600) each routed pod's key by its host:port (its own, made on the control
machine, or its rig's serving_api_key_file key); the front sends the routers no key, and each router reaches its pods
through nginx's hop on 127.0.0.1:30400 (its HTTP_PROXY), which sends each pod its key;
{install_root}/gateway/venv-<hash>/ holds vllm-router from the hash-pinned files/router/requirements.txt
(pip --require-hashes, from gateway_pip_index_url); one rigup-router@<model>.service per served model routes to
the rigs serving it (consistent hash on the session header, health checks, retries), its arguments in
{install_root}/gateway/routers/<model>.env; routes.json has one route per rig and served model, from each rig's
provenance record and its running unit, read after every rig's serving phase in this run (a rig outside the run
is connected to for that read; one that cannot be read keeps the routes it had).
Reads: gateway_group, gateway_bind_address, gateway_port, gateway_api_key_file, gateway_clients,
gateway_tls_cert_file, gateway_tls_key_file, gateway_tls_ca_file, gateway_plain_http, the fleet CA's knobs
(fleet_ca_dir, fleet_ca_cert_file, fleet_ca_key_file, fleet_ca_key_passphrase_file, fleet_cert_days,
fleet_cert_renew_days), gateway_pip_index_url, gateway_health_check_interval_s,
gateway_num_retries, gateway_ready_timeout_s, install_root, and every rig's serving_api_key_file, fleet_ca_dir,
ssh_hostname and install_root.
Restarts: nginx when its site, keys, dispatch or certificate changed (judged on the host, so an interrupted run is
finished by the next), once nginx -t accepts them; then a router when its venv, environment file or unit changed
after it started (after nginx: a router reaches its pods through nginx's hop); then removes the venvs of earlier
pins. A router that does not come up healthy, a configuration nginx -t refuses, or one nginx starts on but that
does not answer its readiness wait, puts the last good configuration back ({install_root}/gateway/last-good.tar,
0600, recorded once the entrance serves) and fails the host with one line; nginx is not restarted onto a configuration it refuses.
rigup-entrance-usage.service counts nginx's usage log per client (requests and tokens) for /metrics/.
Not idempotent: "Wait for the entrance to answer" runs only after nginx (re)started.
Included by deploy.py on gateway_group hosts that passed preflight only.
"""

from io import StringIO

from pyinfra import host, state
from pyinfra.api.hiddenvalue import HiddenValue
from pyinfra.operations import files

from rigup.desired.entrance import NGINX_PACKAGES, USAGE_UNIT, key_map_text, pod_key_text, usage_unit_text
from rigup.desired.fleet_ca import FleetCAError, certificate_names
from rigup.desired.gateway import (
    FRONT_UNIT,
    REQUIREMENTS_FILE,
    TLS_SERVICE,
    UNIT_FILE,
    GatewayError,
    requirements_sha256,
    router_unit_text,
)
from rigup.desired.knobs import KnobError
from rigup.desired.secrets import SecretError
from rigup.operations.apt import os_packages
from rigup.operations.fleet_certs import issued_certificate
from rigup.operations.gateway import (
    entrance_last_good,
    entrance_routes,
    front_answers,
    front_runs_current,
    gateway_venv,
    legacy_gateway_removed,
    other_venvs_removed,
    routers_run_current,
)
from rigup.operations.planning_errors import stop_the_run_on
from rigup.operations.serving import secret_file
from rigup.operations.units import unit_runs_current_files
from rigup.rig import ENTRANCE_USAGE_SCRIPT
from rigup.runstate import decided_routes, fleet_plan

with stop_the_run_on(host, GatewayError, SecretError, KnobError):
    plan = fleet_plan(state).host(host.name).gateway()  # routes to every rig of the fleet
assert plan is not None  # deploy.py includes this file on gateway_group hosts only
paths = plan.paths
packages = [*NGINX_PACKAGES, "python3-venv", "curl"]
os_packages(name="Install nginx (with njs), python3-venv and curl for the entrance", packages=packages,
            no_recommends=True)  # apt's lists refreshed only when one is missing
legacy_gateway_removed(name="Remove LiteLLM's gateway of an earlier rigup", root=paths.root)
files.link(name="Remove the nginx package's default site", path="/etc/nginx/sites-enabled/default", present=False)
files.directory(name="Create the entrance directory", path=paths.root, mode="755")
files.put(
    name="Upload the router's hash-pinned requirements",
    src=str(REQUIREMENTS_FILE),
    dest=paths.requirements_file,
    mode="644",
)
gateway_venv(
    name="Build the router venv (vllm-router, pinned)",
    venv=paths.venv,
    requirements=paths.requirements_file,
    requirements_sha256=requirements_sha256(),
    index_url=plan.pip_index_url,
)
secret_file(
    name="Write the entrance's client keys (0600 nginx map)",
    path=paths.key_map,
    content=HiddenValue(key_map_text(plan.clients)),
)
front_files = [paths.site_file, paths.key_map, paths.pod_key, paths.dispatch_js]
ready_at, connect_to, ca_pem = plan.readiness_url, None, None
if plan.fleet_ca_issues:  # issued (or renewed) now for the host's names; reused while still good
    fleet_ca, issued = issued_certificate(host, TLS_SERVICE, plan.cert_sans)
    cert_pem, key_pem, ca_pem = issued.cert.read_text(), issued.key.read_text(), fleet_ca.cert_pem
elif plan.tls_files is not None:  # the user's; the key checked 0600 on the control machine by the plan
    cert_pem, key_pem = (open(path).read() for path in plan.tls_files)
    ca_pem = open(plan.client_ca).read() if plan.client_ca is not None else None
    with stop_the_run_on(host, FleetCAError):
        ready_at, connect_to = plan.readiness(certificate_names(plan.tls_files[0]))
if plan.tls is not None:
    files.put(name="Upload the entrance's certificate", src=StringIO(cert_pem), dest=paths.tls_cert, mode="644")
    secret_file(name="Upload the entrance's TLS key (0600)", path=paths.tls_key, content=HiddenValue(key_pem))
    if ca_pem is not None:
        files.put(name="Upload the CA certificate the entrance's readiness wait trusts", src=StringIO(ca_pem),
                  dest=paths.tls_ca, mode="644")
    front_files += [paths.tls_cert, paths.tls_key]
else:  # gateway_plain_http: no certificate or key left behind
    for path in (paths.tls_cert, paths.tls_key, paths.tls_ca):
        files.file(name=f"Remove the entrance's {path.rpartition('/')[2]} (plain HTTP)", path=path, present=False)
files.put(
    name="Write the routers' systemd unit (one instance per served model)",
    src=StringIO(router_unit_text(paths)),
    dest=UNIT_FILE,
    mode="644",
)
entrance_routes(
    name="Write the entrance routes from what each rig serves now",
    paths=paths,
    rigs=plan.rigs,
    install_roots=plan.install_roots,
    health_check_interval_s=plan.health_check_interval_s,
    num_retries=plan.num_retries,
    bind_address=plan.bind_address,
    port=plan.port,
    tls=plan.tls,
    score_sample_rate=plan.score_sample_rate,
)
secret_file(
    name="Write each pod's key the entrance's hop sends it (0600 nginx map)",
    path=paths.pod_key,
    # when it runs: the routes entrance_routes decided just before, from what the rigs serve
    content=lambda: pod_key_text(plan.pod_keys(decided_routes(host).routes)),
)
files.put(name="Upload rigup-entrance-usage (requests and tokens per client)", src=str(ENTRANCE_USAGE_SCRIPT),
          dest=paths.usage_counter, mode="755")
files.put(name="Write rigup-entrance-usage's unit", src=StringIO(usage_unit_text(paths)),
          dest=f"/etc/systemd/system/{USAGE_UNIT}", mode="644")
unit_runs_current_files(name="Run rigup-entrance-usage on its current script and unit", unit=USAGE_UNIT,
                        files=[paths.usage_counter, f"/etc/systemd/system/{USAGE_UNIT}"])
front = front_runs_current(
    name="Run the entrance's nginx on its current site, keys and dispatch (restart only on a change, once nginx -t passes)",
    unit=FRONT_UNIT,
    files=front_files,
    paths=paths,
)
front_answers(
    name="Wait for the entrance to answer",
    url=ready_at,
    timeout_s=plan.ready_timeout_s,
    unit=FRONT_UNIT,
    paths=paths,
    ca_file=paths.tls_ca if ca_pem is not None else None,  # none: the host's trust store (a public CA's)
    connect_to=connect_to,
    _if=front.did_change,
)
# after nginx: a router starting waits for its pods through nginx's hop (its HTTP_PROXY), which must serve by then
routers_run_current(
    name="Run one router per served model on its current venv, routes and unit (restart only on a change)",
    paths=paths,
    timeout_s=plan.ready_timeout_s,
)
entrance_last_good(name="Record the entrance's configuration as the last good one", paths=paths,
                   files=[*front_files, paths.models_json, paths.config_file, UNIT_FILE])
other_venvs_removed(name="Remove the venvs of earlier router pins", root=paths.root, keep=paths.venv)
