"""Real Debian packages for the test bed: the stand-in Ubuntu archive's `universe` component, and real
programs (promtool, prometheus, node_exporter) for tests on the control machine.

Fleet monitoring installs Prometheus and node_exporter from the OS archive (in Ubuntu's `universe`), and
the fleet's image mirror the distribution registry (`docker-registry`, also in `universe`).
Those are not simulated: the hub serves Debian bookworm's own .debs (the hosts are Debian 12), so hosts
run the real programs under their real units, users and default files. What is served:

  ROOTS (prometheus, prometheus-node-exporter, prometheus-alertmanager, docker-registry, nginx and its njs module)
  and every package of their Depends/Pre-Depends closure (no Recommends/Suggests) that the test-bed image does not already hold.

The image's package set is computed, not read from a built image, so the archive's content does not
depend on whether an image exists yet: `image_package_set` repeats what `debootstrap --variant=minbase
--include=<image.PACKAGES>` selects (every Priority: required package, usr-is-merged on bookworm, apt,
the includes, then the first alternative of every Depends/Pre-Depends, real packages only, until
nothing new comes in: debootstrap's resolve_deps). `missing_in_image` checks the result against a built
image's dpkg status (the e2e tests do), so a drift between the two shows up as a named package.

Everything is cached under <test-bed cache>/debian-archive/ (image.cache_dir):

  <suite>-<mirror hash>/          a private apt root (apt-get update once; reused, never refreshed unless
                                  a download finds the version gone from the archive)
  manifest-<key>.json             the resolved set: name, version, sha256, size, pool path, relations;
                                  key = hash of the suite's InRelease, ROOTS, the image spec, RESOLVER
  debs/<name>_<version>_<arch>.deb  the downloads (apt-get download; the file names carry the versions,
                                  so a new version is a new file and nothing downloaded is fetched again)
  programs/<name>_<version>/      a package's files (dpkg-deb -x), for `program`

    python -m rigup_testbed.debarchive            resolve + download, print the manifest
    python -m rigup_testbed.debarchive promtool   print the path of promtool (extracting it)
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from rigup_testbed.image import ImageSpec, cache_dir

ROOTS: tuple[str, ...] = ("prometheus", "prometheus-node-exporter", "prometheus-alertmanager", "docker-registry", "nginx",
                          "libnginx-mod-http-js")  # nginx + njs: the fleet entrance's front (issue 44)
KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")
ARCH = "amd64"
RESOLVER = 2  # bump when the resolution below changes in a way its inputs cannot see
FIELDS = ("Package", "Version", "Architecture", "Priority", "Source", "Depends", "Pre-Depends", "Provides",
          "Filename", "Size", "SHA256")

# Programs tests may run on the control machine: name -> (package, path inside it).
PROGRAMS: dict[str, tuple[str, str]] = {
    "promtool": ("prometheus", "/usr/bin/promtool"),
    "prometheus": ("prometheus", "/usr/bin/prometheus"),
    "node_exporter": ("prometheus-node-exporter", "/usr/bin/prometheus-node-exporter"),
    "alertmanager": ("prometheus-alertmanager", "/usr/bin/prometheus-alertmanager"),
    "amtool": ("prometheus-alertmanager", "/usr/bin/amtool"),
    "nginx": ("nginx", "/usr/sbin/nginx"),
}


class ArchiveError(RuntimeError):
    """Debian's archive could not give what the test bed needs (unreachable, or a package missing)."""


# --- Debian control data -------------------------------------------------------------------------


def parse_control(text: str, fields: Iterable[str] | None = None) -> list[dict[str, str]]:
    """Stanzas of a Packages index or a dpkg status file (continuation lines dropped: none of the fields
    read here is multi-line)."""
    wanted = set(fields) if fields is not None else None
    out = []
    for block in text.split("\n\n"):
        stanza: dict[str, str] = {}
        for line in block.split("\n"):
            if not line or line[0] in " \t#":
                continue
            key, _, value = line.partition(":")
            if wanted is None or key in wanted:
                stanza[key] = value.strip()
        if "Package" in stanza:
            out.append(stanza)
    return out


Relation = tuple[str, str, str]  # (name, operator or "", version or "")
_REL = re.compile(r"^\s*([a-z0-9][a-z0-9+.\-]*)(?::[a-z0-9\-]+)?\s*(?:\(\s*(<<|<=|=|>=|>>|<|>)\s*([^)\s]+)\s*\))?\s*(?:\[.*\])?\s*$")


def parse_relations(field: str) -> list[list[Relation]]:
    """A Depends-style field: groups (all needed) of alternatives (one is enough)."""
    groups = []
    for group in field.split(","):
        if not group.strip():
            continue
        alts = []
        for alt in group.split("|"):
            m = _REL.match(alt)
            if m is None:
                raise ArchiveError(f"cannot parse relation {alt!r} in {field!r}")
            alts.append((m.group(1), m.group(2) or "", m.group(3) or ""))
        groups.append(alts)
    return groups


def _order(c: str) -> int:
    if c == "~":
        return -1
    if c.isdigit():
        return 0
    if c.isalpha():
        return ord(c)
    return ord(c) + 256


def _compare_part(a: str, b: str) -> int:
    i = j = 0
    while i < len(a) or j < len(b):
        first_diff = 0
        while (i < len(a) and not a[i].isdigit()) or (j < len(b) and not b[j].isdigit()):
            ac = _order(a[i]) if i < len(a) and not a[i].isdigit() else 0
            bc = _order(b[j]) if j < len(b) and not b[j].isdigit() else 0
            if ac != bc:
                return ac - bc
            i += 1
            j += 1
        while i < len(a) and a[i] == "0":
            i += 1
        while j < len(b) and b[j] == "0":
            j += 1
        while i < len(a) and a[i].isdigit() and j < len(b) and b[j].isdigit():
            if not first_diff:
                first_diff = ord(a[i]) - ord(b[j])
            i += 1
            j += 1
        if i < len(a) and a[i].isdigit():
            return 1
        if j < len(b) and b[j].isdigit():
            return -1
        if first_diff:
            return first_diff
    return 0


def compare_versions(a: str, b: str) -> int:
    """dpkg's version order (lib/dpkg/version.c): <0, 0 or >0."""

    def split(v: str) -> tuple[int, str, str]:
        epoch, _, rest = v.rpartition(":") if ":" in v else ("0", "", v)
        upstream, _, revision = rest.rpartition("-") if "-" in rest else (rest, "", "")
        return int(epoch or 0), upstream, revision

    ea, ua, ra = split(a)
    eb, ub, rb = split(b)
    if ea != eb:
        return ea - eb
    return _compare_part(ua, ub) or _compare_part(ra, rb)


def satisfies(version: str, op: str, wanted: str) -> bool:
    if not op:
        return True
    c = compare_versions(version, wanted)
    return {"<<": c < 0, "<": c <= 0, "<=": c <= 0, "=": c == 0, ">=": c >= 0, ">": c >= 0, ">>": c > 0}[op]


class Index:
    """A suite's packages, one version each (a Packages file of one suite has one per name)."""

    def __init__(self, stanzas: Iterable[Mapping[str, str]]):
        self.packages: dict[str, dict[str, str]] = {}
        for s in stanzas:
            self.packages[s["Package"]] = dict(s)
        self.providers: dict[str, list[tuple[str, str, str]]] = {}  # virtual -> [(provider, op, version)]
        for name, s in self.packages.items():
            for (virtual, op, version), *_ in parse_relations(s.get("Provides", "")):
                self.providers.setdefault(virtual, []).append((name, op, version))

    def relations(self, name: str) -> list[list[Relation]]:
        s = self.packages[name]
        return parse_relations(s.get("Pre-Depends", "")) + parse_relations(s.get("Depends", ""))


def _satisfied_by(rel: Relation, have: Mapping[str, str], index: Index) -> bool:
    """Is `rel` met by the packages `have` (name -> version), directly or by what they provide?"""
    name, op, version = rel
    if name in have and satisfies(have[name], op, version):
        return True
    for provider, pop, pversion in index.providers.get(name, ()):
        if provider in have and (not op or (pop == "=" and satisfies(pversion, op, version))):
            return True
    return False


def image_package_set(index: Index, spec: ImageSpec) -> dict[str, str]:
    """What `debootstrap --variant=minbase --include=<spec.packages> <suite>` installs, name -> version
    (debootstrap 1.0.128: scripts/debian-common work_out_debs, functions resolve_deps)."""
    required = {n for n, s in index.packages.items() if s.get("Priority") == "required"}
    exclude = set()
    if spec.suite == "bookworm":  # merged /usr marked done; the live migration package kept out
        required.add("usr-is-merged")
        exclude.add("usrmerge")
    elif spec.suite not in ("buster", "bullseye"):
        exclude.add("usrmerge")
    base = {"apt", *spec.packages}
    if spec.mirror.startswith("https://"):
        base.add("ca-certificates")
    chosen: set[str] = set()
    todo = {n for n in required | base if n in index.packages}
    while todo:
        chosen |= todo
        new = set()
        for name in todo:
            for group in index.relations(name):
                first = group[0][0]  # debootstrap takes the first alternative, drops it when it is virtual
                if first not in exclude and first in index.packages and first not in chosen:
                    new.add(first)
        todo = new
    return {n: index.packages[n]["Version"] for n in sorted(chosen)}


def closure(index: Index, roots: Iterable[str], installed: Mapping[str, str]) -> list[str]:
    """What `apt-get install --no-install-recommends <roots>` adds to a system holding `installed`:
    the roots and, for every Depends/Pre-Depends group no installed or chosen package meets, its first
    alternative the index can satisfy (a real package of a fitting version, else a provider)."""
    chosen: dict[str, str] = {}
    todo = list(roots)
    for name in todo:
        if name not in index.packages:
            raise ArchiveError(f"{name} is not in the archive's index")
    while todo:
        name = todo.pop(0)
        if name in chosen:
            continue
        chosen[name] = index.packages[name]["Version"]
        for group in index.relations(name):
            have = {**installed, **chosen}
            if any(_satisfied_by(rel, have, index) for rel in group):
                continue
            pick = None
            for rel_name, op, version in group:
                real = index.packages.get(rel_name)
                if real is not None and satisfies(real["Version"], op, version):
                    pick = rel_name
                    break
                providers = sorted(p for p, pop, pv in index.providers.get(rel_name, ())
                                   if not op or (pop == "=" and satisfies(pv, op, version)))
                if providers:
                    pick = providers[0]
                    break
            if pick is None:
                raise ArchiveError(f"{name}: nothing in the archive satisfies {group}")
            if pick not in chosen and pick not in todo:
                todo.append(pick)
    return sorted(chosen)


def installed_from_status(text: str) -> dict[str, str]:
    """name -> version of the packages a dpkg status file lists as installed."""
    return {s["Package"]: s["Version"] for s in parse_control(text, ("Package", "Version", "Status"))
            if s.get("Status", "").endswith(" installed") and s.get("Status", "").split()[0] == "install"}


# --- the archive ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArchiveDeb:
    name: str
    version: str
    arch: str
    source: str
    filename: str  # pool path in Debian's archive: pool/main/<p>/<source>/<file>
    sha256: str
    size: int
    depends: str = ""
    pre_depends: str = ""
    provides: str = ""  # virtual names it stands for (nginx: nginx-abi-1.22.1-7, which its modules depend on)

    @property
    def basename(self) -> str:
        return self.filename.rsplit("/", 1)[-1]

    @classmethod
    def from_stanza(cls, s: Mapping[str, str]) -> ArchiveDeb:
        return cls(name=s["Package"], version=s["Version"], arch=s.get("Architecture", ARCH),
                   source=s.get("Source", s["Package"]).split(" ")[0], filename=s["Filename"], sha256=s["SHA256"],
                   size=int(s["Size"]), depends=s.get("Depends", ""), pre_depends=s.get("Pre-Depends", ""),
                   provides=s.get("Provides", ""))


def missing_in_image(debs: Iterable[ArchiveDeb], image_status: str) -> list[str]:
    """Relations of `debs` that neither they nor a built image's installed packages (its dpkg status
    text) satisfy: empty when installing them on that image needs nothing else."""
    debs = list(debs)
    installed = installed_from_status(image_status)
    have = {**installed, **{d.name: d.version for d in debs}}
    provided = Index([s for s in parse_control(image_status, ("Package", "Version", "Provides")) if s["Package"] in installed] +
                     [{"Package": d.name, "Version": d.version, **({"Provides": d.provides} if d.provides else {})}
                      for d in debs])
    out = []
    for d in debs:
        for group in parse_relations(d.pre_depends) + parse_relations(d.depends):
            if not any(_satisfied_by(rel, have, provided) for rel in group):
                out.append(f"{d.name}: {' | '.join(' '.join(x for x in r if x) for r in group)}")
    return out


class DebianArchive:
    """Debian's archive for one suite, through a private apt root (the control machine's own apt
    configuration and lists are neither read nor changed)."""

    def __init__(self, base: Path | None = None, spec: ImageSpec | None = None):
        self.spec = spec or ImageSpec()
        self.base = (base or cache_dir() / "debian-archive").resolve()
        mirror_id = hashlib.sha256(self.spec.mirror.encode()).hexdigest()[:8]
        self.root = self.base / f"{self.spec.suite}-{mirror_id}"
        self.debs_dir = self.base / "debs"
        self._index: tuple[tuple[Path, int], Index] | None = None

    # apt, confined to self.root
    def _configure(self) -> Path:
        if not KEYRING.is_file():
            raise ArchiveError(f"{KEYRING} is missing: install debian-archive-keyring (debootstrap needs it too)")
        r = self.root
        for d in ("etc/apt/sources.list.d", "etc/apt/apt.conf.d", "etc/apt/preferences.d", "etc/apt/trusted.gpg.d",
                  "var/lib/apt/lists/partial", "var/cache/apt/archives/partial", "var/lib/dpkg"):
            (r / d).mkdir(parents=True, exist_ok=True)
        (r / "var/lib/dpkg/status").touch()
        (r / "etc/apt/sources.list").write_text(
            f"deb [arch={ARCH} signed-by={KEYRING}] {self.spec.mirror} {self.spec.suite} main\n")
        conf = r / "apt.conf"
        conf.write_text(
            f'Dir "{r}/";\nDir::State::status "{r}/var/lib/dpkg/status";\nAPT::Architecture "{ARCH}";\n'
            f'APT::Architectures {{ "{ARCH}"; }};\nAPT::Sandbox::User "root";\nDebug::NoLocking "true";\n'
            'Acquire::Languages "none";\nAcquire::Retries "2";\nAcquire::http::Timeout "30";\n'
            'Acquire::https::Timeout "30";\n'
            'Dir::Cache::pkgcache "";\nDir::Cache::srcpkgcache "";\n')  # no 60 MB of binary caches
        return conf

    def apt(self, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ, APT_CONFIG=str(self._configure()), LC_ALL="C")
        return subprocess.run(["apt-get", "-q", *args], env=env, cwd=cwd, text=True, capture_output=True)

    def update(self) -> None:
        proc = self.apt("update")
        text = proc.stdout + proc.stderr
        if proc.returncode != 0 or re.search(r"^(E:|W: Failed to fetch|Err:)", text, re.M):
            raise ArchiveError(
                f"cannot reach Debian's archive {self.spec.mirror} (suite {self.spec.suite}) to fetch the real "
                f"packages of the stand-in Ubuntu archive's universe ({', '.join(ROOTS)}); set "
                f"RIGUP_TESTBED_DEBIAN_MIRROR to a reachable mirror. apt-get update said:\n{text[-1500:]}")

    def _lists(self) -> tuple[Path, Path]:
        lists = self.root / "var/lib/apt/lists"
        release = sorted(lists.glob(f"*_dists_{self.spec.suite}_InRelease"))
        packages = sorted(lists.glob(f"*_dists_{self.spec.suite}_main_binary-{ARCH}_Packages"))
        if not release or not packages:
            raise FileNotFoundError(lists)
        return release[0], packages[0]

    def lists(self) -> tuple[Path, Path]:
        """(InRelease, Packages) of the suite, fetched once."""
        try:
            return self._lists()
        except FileNotFoundError:
            self.update()
            try:
                return self._lists()
            except FileNotFoundError:
                raise ArchiveError(f"apt-get update left no {self.spec.suite} index under {self.root}") from None

    def index(self) -> Index:
        """The suite's index (parsing it takes a second or two: kept while the file stays the same)."""
        packages = self.lists()[1]
        stamp = (packages, packages.stat().st_mtime_ns)
        if self._index is None or self._index[0] != stamp:
            self._index = (stamp, Index(parse_control(packages.read_text(), FIELDS)))
        return self._index[1]

    # the resolved set
    def manifest(self, roots: tuple[str, ...] = ROOTS) -> list[ArchiveDeb]:
        """ROOTS and their Depends/Pre-Depends closure beyond the image's packages (cached per index)."""
        with self._lock():
            return self._manifest(roots)

    def _manifest(self, roots: tuple[str, ...]) -> list[ArchiveDeb]:
        release, _ = self.lists()
        key = hashlib.sha256(release.read_bytes() + json.dumps(
            {"roots": sorted(roots), "image": self.spec.key, "packages": sorted(self.spec.packages),
             "resolver": RESOLVER}, sort_keys=True).encode()).hexdigest()[:16]
        path = self.base / f"manifest-{key}.json"
        if path.exists():
            return [ArchiveDeb(**d) for d in json.loads(path.read_text())["debs"]]
        index = self.index()
        names = closure(index, roots, image_package_set(index, self.spec))
        debs = [ArchiveDeb.from_stanza(index.packages[n]) for n in names]
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"suite": self.spec.suite, "mirror": self.spec.mirror, "roots": list(roots),
                                   "debs": [asdict(d) for d in debs]}, indent=1) + "\n")
        tmp.rename(path)
        return debs

    # the files
    def path_of(self, deb: ArchiveDeb) -> Path:
        return self.debs_dir / deb.basename

    def debs(self, names: Iterable[str] | None = None, roots: tuple[str, ...] = ROOTS) -> list[Path]:
        """The .deb files of the manifest (or of `names` in it), downloaded when missing."""
        names = None if names is None else set(names)
        with self._lock():
            manifest = self._manifest(roots)
            wanted = [d for d in manifest if names is None or d.name in names]
            missing = [d for d in wanted if not self.path_of(d).is_file()]
            if missing:
                try:
                    self._download(missing)
                except ArchiveError:
                    # The archive moved on (a point release drops superseded versions): fetch the index
                    # again and resolve anew.
                    self.update()
                    manifest = self._manifest(roots)
                    wanted = [d for d in manifest if names is None or d.name in names]
                    self._download([d for d in wanted if not self.path_of(d).is_file()])
            return [self.path_of(d) for d in wanted]

    def _download(self, debs: list[ArchiveDeb]) -> None:
        self.debs_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=self.debs_dir, prefix=".download-") as tmp:
            proc = self.apt("download", *[f"{d.name}={d.version}" for d in debs], cwd=Path(tmp))
            if proc.returncode != 0:
                raise ArchiveError(f"apt-get download from {self.spec.mirror} failed:\n{(proc.stdout + proc.stderr)[-1500:]}")
            got = {p.name.split("_", 1)[0]: p for p in Path(tmp).glob("*.deb")}
            for d in debs:
                f = got.get(d.name)
                if f is None:
                    raise ArchiveError(f"apt-get download gave no file for {d.name}={d.version}")
                digest = hashlib.sha256(f.read_bytes()).hexdigest()
                if digest != d.sha256:
                    raise ArchiveError(f"{f.name}: sha256 {digest}, the index says {d.sha256}")
                f.chmod(0o644)
                f.rename(self.path_of(d))

    def program(self, name: str) -> Path:
        """A program of PROGRAMS, extracted from its package (dpkg-deb -x) once per version."""
        package, inside = PROGRAMS[name]
        (deb,) = self.debs([package])
        with self._lock():
            dest = self.base / "programs" / deb.name.removesuffix(".deb")
            if not dest.is_dir():
                dest.parent.mkdir(parents=True, exist_ok=True)
                tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".extract-"))
                try:
                    subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp)], check=True, capture_output=True)
                    tmp.rename(dest)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
        path = dest / inside.lstrip("/")
        if not os.access(path, os.X_OK):
            raise ArchiveError(f"{deb.name} holds no program {inside}")
        return path

    def _lock(self) -> contextlib.AbstractContextManager[None]:
        self.base.mkdir(parents=True, exist_ok=True)
        return _locked(self.base / ".lock")


_HELD: dict[Path, int] = {}


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` across processes, re-entrant within this one (manifest inside debs
    inside program)."""
    if _HELD.get(path):
        _HELD[path] += 1
        try:
            yield
        finally:
            _HELD[path] -= 1
        return
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        _HELD[path] = 1
        try:
            yield
        finally:
            del _HELD[path]


# --- module-level conveniences -------------------------------------------------------------------


def universe_manifest(spec: ImageSpec | None = None) -> list[ArchiveDeb]:
    return DebianArchive(spec=spec).manifest()


def universe_debs(spec: ImageSpec | None = None) -> list[Path]:
    return DebianArchive(spec=spec).debs()


def program(name: str) -> Path:
    return DebianArchive().program(name)


def promtool() -> Path:
    """Debian bookworm's promtool (from the prometheus package the hub's archive serves)."""
    return program("promtool")


def prometheus() -> Path:
    return program("prometheus")


def node_exporter() -> Path:
    return program("node_exporter")


def main(argv: list[str]) -> int:
    archive = DebianArchive()
    if argv:
        for name in argv:
            print(archive.program(name))
        return 0
    paths = {p.name: p for p in archive.debs()}
    for d in archive.manifest():
        print(f"{d.name} {d.version} {d.size} {paths[d.basename]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
