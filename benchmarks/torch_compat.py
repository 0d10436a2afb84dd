"""Which torch names the project uses that an older torch does not define: the check behind pyproject's claim.

    pip download --no-deps torch==2.11.0 -d /tmp/t211           # the wheel of the oldest torch claimed
    python -m benchmarks.torch_compat /tmp/t211/torch-2.11.0-*.whl

Every ``torch.a.b`` chain, ``from torch.x import y`` and keyword argument of a call to a torch callable in
fp4offload/, benchmarks/ and tests/ is resolved against the installed torch; the file that defines it is then
looked up in the other wheel's Python sources (and its .pyi stubs, for names bound in C++). A name or keyword
that does not occur there is printed. A static check: it cannot see behaviour changes, which the GPU proof
(benchmarks/gpu_check.sh, on the device's torch) covers. Exit status 1 when something is missing.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _aliases(tree: ast.AST) -> dict[str, str]:
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    out[a.asname or a.name.split(".")[0]] = a.name if a.asname else "torch"
    return out


def _chain(node: ast.AST, alias: dict[str, str]) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in alias:
        return ".".join([alias[node.id], *reversed(parts)])
    return None


def uses(roots: list[Path]) -> tuple[dict[str, str], dict[tuple[str, str], str]]:
    """(chain -> a file using it, (callable chain, keyword) -> a file using it)."""
    chains, keywords = {}, {}
    for root in roots:
        for f in sorted(root.rglob("*.py")):
            try:
                tree = ast.parse(f.read_text())
            except SyntaxError:
                continue
            alias = _aliases(tree)
            for full in alias.values():
                chains.setdefault(full, str(f))
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and (c := _chain(node, alias)):
                    chains.setdefault(c, str(f))
                if isinstance(node, ast.Call) and (c := _chain(node.func, alias) or alias.get(getattr(node.func,
                                                                                                   "id", ""))):
                    for k in node.keywords:
                        if k.arg:
                            keywords.setdefault((c, k.arg), str(f))
    return chains, keywords


def _resolve(chain: str):
    """(object, its attribute name or None for a module) in the installed torch, or None."""
    parts = chain.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except Exception:  # not a module at this depth
            continue
        name, owner = None, obj
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return None
            owner, obj, name = obj, getattr(obj, attr), attr
        return obj, name, owner
    return None


def _defining_file(obj, owner, here: Path) -> Path | None | bool:
    """The file under `here` that defines obj (data: its owner module's file); False when obj is not torch's."""
    target = obj if inspect.isroutine(obj) or inspect.isclass(obj) else owner
    try:
        src = inspect.getsourcefile(inspect.unwrap(target))
    except TypeError:
        return None
    if src and not src.startswith(str(here)):
        return False
    return Path(src).relative_to(here) if src else None


def check(old: Path, roots: list[Path]) -> list[str]:
    import torch

    here = Path(torch.__file__).parent
    stubs = "\n".join(p.read_text(errors="ignore") for p in old.rglob("*.pyi"))
    chains, keywords = uses(roots)
    missing = []

    def defined(word: str, rel: Path | None | bool) -> bool:
        """Whether `word` occurs in the old torch's copy of `rel`, in the files beside it (a class re-exported
        under its package's name), or in the stubs."""
        if rel is False:
            return True
        pat = re.compile(rf"\b{re.escape(word)}\b")
        if not rel:  # bound in C++: the stubs
            return bool(pat.search(stubs))
        if not (old / rel).exists():
            return False
        files = [old / rel] + sorted((old / rel).parent.rglob("*.py"))
        return any(f.exists() and pat.search(f.read_text(errors="ignore")) for f in files)

    for chain, where in sorted(chains.items()):
        got = _resolve(chain)
        if got is None:
            continue  # not torch's (or not in this torch either): not this check's business
        obj, name, owner = got
        if name is not None and name.startswith("__"):
            continue
        if name is None:
            f = getattr(obj, "__file__", None)
            rel = Path(f).relative_to(here) if f and f.startswith(str(here)) and f.endswith(".py") else None
            if rel and not (old / rel).exists():
                missing.append(f"module {chain}: {rel} is absent   (used in {where})")
            continue
        if not defined(name, _defining_file(obj, owner, here)):
            missing.append(f"{chain}: not defined   (used in {where})")
    for (chain, kw), where in sorted(keywords.items()):
        got = _resolve(chain)
        if got is None or got[1] is None:
            continue
        if not defined(kw, _defining_file(got[0], got[2], here)):
            missing.append(f"{chain}({kw}=...): keyword not found   (used in {where})")
    return missing


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__)
        return 2
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(argv[0]) as z:
            z.extractall(tmp, [n for n in z.namelist() if n.endswith((".py", ".pyi"))])
        old = Path(tmp) / "torch"
        missing = check(old, [ROOT / "fp4offload", ROOT / "benchmarks", ROOT / "tests"])
    print(f"installed torch {torch.__version__} against {Path(argv[0]).name}: {len(missing)} name(s) missing")
    for m in missing:
        print("  " + m)
    return 1 if missing else 0


if __name__ == "__main__":
    raise SystemExit(main())
