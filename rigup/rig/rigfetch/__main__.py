"""Runs rigfetch: `python3 rigfetch.py ARGS` on a rig (the zipapp, whose __main__ this file is, the package
beside it as rigfetch/), `python -m rigup.rig.rigfetch ARGS` in a checkout.

Python compiles what it imports from a zip archive again at every start (zipimport writes no bytecode):
about 30 ms of every converged re-run's `--check` on each rig. So in the archive the package's modules are
loaded by ArchiveModules, their bytecode kept in __pycache__ beside the archive and used while the archive
is the same file (size, mtime, inode: a new upload is compiled once, on its first run).
"""

import importlib
import marshal
import os
import sys
import zipimport

PACKAGE = "rigfetch"  # the package's name inside the archive


class ArchiveModules:
    """Finder and loader of the package's modules in `archive`; without a writable cache directory (or
    with python3 -B) they are compiled as zipimport would, every time."""

    def __init__(self, archive: str) -> None:
        st = os.stat(archive)
        self.stamp = b"rigfetch-archive %d %d %d\n" % (st.st_size, st.st_mtime_ns, st.st_ino)
        self.cache = os.path.join(os.path.dirname(archive), "__pycache__",
                                  "%s.%s" % (os.path.basename(archive), sys.implementation.cache_tag))
        self.archive = archive
        self.found: dict = {}  # module name -> (the zipimporter of its directory, its path in the archive)

    def find_spec(self, name: str, path: object = None, target: object = None) -> object:
        if name != PACKAGE and not name.startswith(PACKAGE + "."):
            return None
        # a zipimporter finds the modules of one directory of the archive by their last name
        directory = zipimport.zipimporter(os.path.join(self.archive, *name.split(".")[:-1]))
        spec = directory.find_spec(name)
        if spec is None:
            return None
        self.found[name] = (directory, spec.origin)
        spec.loader = self
        return spec

    def create_module(self, spec: object) -> None:
        return None  # the default module object

    def exec_module(self, module: object) -> None:
        exec(self.get_code(module.__name__), module.__dict__)  # type: ignore[attr-defined]

    def get_source(self, name: str) -> str:
        directory, origin = self.found[name]
        return directory.get_data(origin).decode("utf-8")  # tracebacks quote the lines through this

    def get_code(self, name: str) -> object:
        cached = os.path.join(self.cache, name + ".pyc")
        try:
            with open(cached, "rb") as handle:
                data = handle.read()
            if data.startswith(self.stamp):
                return marshal.loads(data[len(self.stamp):])
        except (OSError, ValueError, EOFError, TypeError):
            pass  # none yet, or unreadable: compiled below
        code = compile(self.get_source(name), self.found[name][1], "exec", dont_inherit=True)
        if not sys.dont_write_bytecode:
            try:
                os.makedirs(self.cache, exist_ok=True)
                partial = "%s.%d" % (cached, os.getpid())
                with open(partial, "wb") as handle:
                    handle.write(self.stamp + marshal.dumps(code))
                os.replace(partial, cached)  # a reader sees the whole file or none
            except OSError:
                pass  # a read-only install compiles every time, as zipimport does
        return code


if __name__ == "__main__":
    if __package__:  # python -m rigup.rig.rigfetch: the package imports as any other
        from .cli import main
    else:  # the archive
        sys.meta_path.insert(0, ArchiveModules(__loader__.archive))  # type: ignore[name-defined]
        main = importlib.import_module(PACKAGE + ".cli").main
    sys.exit(main())
