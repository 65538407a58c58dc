"""Which package files `hf-dllm export` may ship as a Hub repo's remote code, checked before anything is written
(`check_remote_code`): transformers' dynamic-module loader must accept them as they are, and the family's list of
files must be closed under their imports. Exported files are never edited: a violation is fixed in the package.
"""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

from .families import DEFAULT_FAMILY, ExportError, model_family

# Packages the remote code may import outside a `try:` block: those every transformers user has. Anything else
# (triton, flash_attn, ...) must sit in `try:` (or under an `if is_..._available():` check), or transformers'
# `check_imports` refuses to load the model without it.
REMOTE_CODE_DEPENDENCIES = ("torch", "transformers")

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # the flat package: the files exported as remote code


def check_remote_code(package_dir: str | os.PathLike = PACKAGE_DIR, family: str = DEFAULT_FAMILY) -> list[Path]:
    """Check the package files exported as remote code for the model family named `family` (its
    `DiffusionFamily.remote_code_files`);
    return their paths in that order.

    transformers copies a Hub repo's code into its module cache and imports it as a package, so each file must:
    exist; import only exported files relatively (`from .<module> import ...`, the form transformers follows to
    fetch them; `from . import <module>` is tolerated but invisible to transformers); never import `hf_dllm`;
    import nothing outside a `try:` block but the standard library and `REMOTE_CODE_DEPENDENCIES` (transformers'
    `check_imports` demands every such import); mention no other `from .x import` at the start of a line, even
    in a docstring (transformers finds relative imports with a regular expression); and be reachable from the
    `auto_map` modules through `from .<module> import` (transformers fetches only those). The list is thereby
    closed: no exported file imports a package file missing from it. Raises `ExportError` listing every violation.
    """
    from transformers.dynamic_module_utils import get_imports, get_relative_imports

    package_dir = Path(package_dir)
    name_of_family = family
    family = model_family(family)
    files = family.remote_code_files
    missing = [name for name in files if not (package_dir / name).is_file()]
    if missing:
        raise ExportError(
            f"remote-code file(s) missing from the package ({package_dir}): {', '.join(missing)}. "
            f"The exported remote code of {family.display_name} is {', '.join(files)} "
            f"({type(family).__name__}.own_remote_code_files and family.SHARED_REMOTE_CODE_FILES)."
        )
    modules = {name.removesuffix(".py") for name in files}
    allowed = set(sys.stdlib_module_names) | set(REMOTE_CODE_DEPENDENCIES)
    problems: list[str] = []
    graph: dict[str, set[str]] = {}
    for name in files:
        path = package_dir / name
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except SyntaxError as error:
            problems.append(f"{name}: does not parse: {error}")
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                # `from .x import y` (what transformers follows), or `from . import x, y` of exported modules
                # (transformers does not see those: they must also be reached some other way, checked below).
                targets = [node.module] if node.module else [alias.name for alias in node.names]
                bad = [target for target in targets if "." in target or target not in modules]
                if node.level != 1 or bad:
                    written = "." * node.level + (node.module or "")
                    problems.append(
                        f"{name}:{node.lineno}: `from {written} import "
                        f"{', '.join(alias.name for alias in node.names)}`: remote code may only import exported "
                        f"files, as `from .<module> import ...`, <module> one of {sorted(modules)}."
                    )
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                for imported in names:
                    if imported.split(".")[0] == "hf_dllm":
                        problems.append(
                            f"{name}:{node.lineno}: imports `{imported}`: remote code runs where hf_dllm is not "
                            "installed; use a relative import of an exported file."
                        )
        unguarded = sorted(set(get_imports(path)) - allowed - {"hf_dllm"})
        if unguarded:
            problems.append(
                f"{name}: imports {unguarded} outside a `try:` block: transformers' check_imports would refuse "
                f"to load the model without them. Only the standard library and {list(REMOTE_CODE_DEPENDENCIES)} "
                "may be imported unguarded; put optional imports in `try: ... except ImportError:`."
            )
        relative = set(get_relative_imports(path))
        unknown = sorted(relative - modules)
        if unknown:
            problems.append(
                f"{name}: transformers sees relative imports of {unknown} (it scans the text, docstrings "
                f"included), which are not exported files {sorted(modules)}; if they belong to the remote code, "
                f"add them to the {name_of_family!r} family's own_remote_code_files."
            )
        graph[name.removesuffix(".py")] = relative & modules
    if not problems:
        roots = {entry.split(".")[0] for entry in family.auto_map.values()}
        reachable = set(roots)
        todo = list(reachable)
        while todo:
            for module in graph.get(todo.pop(), ()):
                if module not in reachable:
                    reachable.add(module)
                    todo.append(module)
        unreachable = [name for name in files if name.removesuffix(".py") not in reachable]
        if unreachable:
            problems.append(
                f"{', '.join(unreachable)} not reached by relative imports from the auto_map modules "
                f"({', '.join(sorted(root + '.py' for root in roots))}): transformers would never download them "
                "from the Hub."
            )
    if problems:
        raise ExportError(
            "the package's remote-code files cannot be exported as they are (fix the package files; exported "
            "files are never edited):\n  - " + "\n  - ".join(problems)
        )
    return [package_dir / name for name in files]
