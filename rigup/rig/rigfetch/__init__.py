"""rigfetch: put locked model files on a rig, verified by SHA-256. Python 3 standard library only.

rigup uploads this package to {install_root}/bin/rigfetch.py as one file, a zipapp that the rig's python3
runs (Ubuntu's; no pip packages): rigup.rig.onefile builds it, the same bytes for the same sources. The
control machine builds the manifest from the lock file; rigfetch never decides what the right bytes are,
it only makes the disk match the manifest.

Its modules, each importing only those before it: manifest (what the control machine and rigfetch agree
on), log (progress and counters), disk (stamps, each file's plan, hashing), pieces (a file in transit),
web (the HTTP client), registry_auth (a registry hub's tokens), peers (this rig's upstreams), download
(one file from its sources), fetcher (the run), fleet_server (serving the rigs below), cli (the command
line); __main__ runs it.

Modes:
  rigfetch.py --manifest M.json --check     read stamps only; print what needs work (JSON); no writes
  rigfetch.py --manifest M.json             fetch/verify until every file matches; print counters (JSON)
  rigfetch.py --manifest M.json --listen A:P --expect-peers N
                                            the same, and serve this rig's files (verified ones, and the
                                            verified pieces of ones still arriving) to N fleet peers

Manifest (JSON; --manifest PATH or --manifest-b64 <urlsafe base64 of zlib-compressed JSON>):
  {"version": 1, "state_dir": "/opt/rigup/state", "reserve_bytes": 0, "piece_size": 4194304,
   "models": [{"name": "qwen3.6-27b-dflash", "dir": "/opt/rigup/models/qwen3.6-27b-dflash",
               "hub_url": "https://huggingface.co/z-lab/Qwen3.6-27B-DFlash/resolve/<commit>/",
               "upstreams": ["http://10.0.0.11:8765/", "http://10.0.0.12:8765/"],
               "files": [{"path": "config.json", "size": 1234, "sha256": "<64 hex>"}]}]}
  A model may say "hub_auth": "registry": its hub is a container registry's blob endpoint
  (https://registry-1.docker.io/v2/<repository>/blobs/, files named sha256:<hex>), read as `docker pull`
  reads it: no HF token; on a 401 with a Bearer challenge, an anonymous token from the challenge's realm
  (the distribution token spec), asked again when it expires; a redirect to another origin drops it.

Fleet chain (upstreams): the rigs ahead of this one in the model's chain, the head first. The head reads
the hub; every other rig reads its nearest live upstream while that one is still receiving, so each
rig's downlink and uplink carry the model once and the hub serves it once. Bytes are forwarded in
pieces (piece_size), and only verified ones. A piece's digest is the SHA-256 of the file up to the
piece's end (a copy of the running whole-file hash, finalized), so checking pieces costs no second pass
over the bytes, and the last piece's digest is the locked SHA-256 itself. The head's digests, taken as
the bytes arrive from the hub (before they touch a disk), are the authority; every other rig checks each
piece against them (asked of the upstreams head first) before its verified mark, which is all it
serves, moves past it. A peer whose piece fails is dropped and the piece is read from the next
upstream, then the hub; a dead peer likewise. The lock's whole-file SHA-256 stays the last gate
before any stamp, on every rig.

How it stays cheap and safe:
  * A verified file gets a stamp (size, mtime_ns, inode, sha256) in {state_dir}/model-stamps.json.
    A file whose stat still matches its stamp is trusted without reading it (--reverify re-hashes).
  * Downloads go to .<name>.rigfetch-part next to the target (same file system), hash while
    streaming, resume with an HTTP Range request, and are renamed into place only after the
    SHA-256 matches. A mismatch deletes the part file and retries (--retries), then fails naming
    the file and both hashes.
  * Files that exist but are not stamped (or --reverify) are hashed in parallel, one thread per
    core (hashlib releases the GIL); only mismatching ones are downloaded again.
  * Secrets (HF token, fleet token) arrive as one JSON line on stdin (--secrets-stdin), never on
    the command line, never in the log.
Progress (bytes, rate, ETA) goes to stderr and to {state_dir}/fetch.log.
"""
