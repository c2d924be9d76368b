"""MkDocs hook: the reference pages, generated from the code each time the site is built.

- `reference/config.md`: every config key, found by walking the dataclass fields of the root schema
  (`gpujobs.config.schema.JobConfig`) down every nested schema; a plug-in field (typed `Any`: `model`,
  `data`) takes each schema its config group names by `_target_` (`conf/<key>/*.yaml`). Each key shows
  its type, the schema's default, its declared bounds in the validator's own words
  (`gpujobs.config.validate.allowed_text`) and the field's docstring.
- `reference/cli.md`: `gpujobs --help` and every subcommand's `--help`, run as users run them, from the
  registry of subcommands (`gpujobs.cli.main.COMMANDS`).
- `reference/exit-codes.md`: what each command's docstring says of its exit codes, and every `EXIT_*`
  constant of the package with its comment.
- `reference/modules.md`: every module of the packages with the first line of its docstring.

A renamed key, command or module changes these pages, so a link to what is gone fails `mkdocs build
--strict`, and so does a code span of a hand-written page that names a config key or a gpujobs module the
code no longer has (`stale_names`). `tests/test_docs.py` compares the config reference with `--cfg job`.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import html
import importlib
import inspect
import itertools
import keyword
import logging
import os
import re
import subprocess
import sys
import textwrap
import typing
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path[:1]:
    sys.path.insert(0, str(REPO))  # the checkout's code, whatever gpujobs the environment installed

BOUNDS_KEY = "gpujobs.bounds"  # the metadata key of `gpujobs.config.validate.bounds`
_CODE_SPAN = re.compile(r"(`[^`]*`)")
_EXIT = re.compile(r"^EXIT_[A-Z_]+$")
PACKAGES = ("gpujobs", "jobs", "hydra_plugins")
#: A code span's leading dotted name (a `+` override prefix skipped): a config key or a module.
_NAME_SPAN = re.compile(r"`\+*([a-z_]+(?:\.[A-Za-z0-9_*]+)+)")
_cache: list[Entry] = []
log = logging.getLogger("mkdocs.hooks.reference")  # under `mkdocs`: --strict counts its warnings


@dataclasses.dataclass(frozen=True)
class Entry:
    """One config key of the reference."""

    key: str
    anchor: str
    type: str
    default: str
    allowed: str
    """The declared bounds in words ("" where the field declares none)."""
    doc: str


@dataclasses.dataclass(frozen=True)
class Section:
    """A schema's keys under one prefix (`cluster.`), with the schema's docstring as its introduction."""

    title: str
    anchor: str
    intro: str
    entries: list[Entry]


def markdown(text: str) -> str:
    """`text` (a docstring) safe as Markdown: `<`, `>` and `&` escaped outside code spans (a bare
    `<attempt>` would be swallowed as an HTML tag)."""
    return "".join(part if part.startswith("`") else html.escape(part, quote=False)
                   for part in _CODE_SPAN.split(text))


def cell(text: str) -> str:
    """`text` as one Markdown table cell: one line, `|` escaped."""
    return markdown(" ".join(text.split())).replace("|", "\\|")


def user_key(name: str, section: str = "") -> str:
    """The key users write for a field: the schema's alias where it declares one (`checkpoint.async` is the
    field `background`, `async` being a Python keyword), else the field's name."""
    from gpujobs.config.schema import KEY_ALIASES

    for key, field_name in KEY_ALIASES.get(section, {}).items():
        if field_name == name:
            return key
    bare = name.rstrip("_")
    return bare if name.endswith("_") and keyword.iskeyword(bare) else name


def attribute_docs(schema: type[Any]) -> dict[str, str]:
    """Each field's docstring: the string literal right after its annotated assignment (PEP 257's
    attribute docstrings, which `help()` does not keep), from the class and its dataclass bases."""
    docs: dict[str, str] = {}
    for cls in reversed(schema.__mro__):
        if not dataclasses.is_dataclass(cls) or cls is object:
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
        statements = body.body if isinstance(body, ast.ClassDef) else []
        for node, after in itertools.pairwise(statements):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(
                    after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
                docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _unwrap(hint: Any) -> tuple[Any, bool]:
    """`Optional[X]` -> (X, True); anything else -> (hint, False)."""
    if typing.get_origin(hint) is typing.Union:
        inner = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if len(inner) == 1:
            return inner[0], len(inner) < len(typing.get_args(hint))
    return hint, False


def type_text(hint: Any) -> str:
    """A field's type in words: `int`, `list of int`, `map of str to float`, `float or null`; a choice (an enum
    of the schema) is `str`, its values in `allowed`."""
    inner, optional = _unwrap(hint)
    origin, args = typing.get_origin(inner), typing.get_args(inner)
    if isinstance(inner, type) and issubclass(inner, enum.Enum):
        text = "str"
    elif origin is list:
        text = f"list of {type_text(args[0])}"
    elif origin is dict:
        text = f"map of {type_text(args[0])} to {type_text(args[1])}"
    else:
        text = getattr(inner, "__name__", str(inner))
    return f"{text} or null" if optional else text


def value_text(value: Any) -> str:
    """A default as YAML writes it: `null`, `true`, `[64, 32]`, `{}`."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(value_text(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {value_text(v)}" for k, v in value.items()) + "}"
    return str(value)


def default_text(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        return value_text(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return value_text(f.default_factory())
    return "required"


def allowed(f: dataclasses.Field[Any], hint: Any) -> str:
    """The field's declared bounds in the words of the validator's errors; "" where it declares none."""
    from gpujobs.config.validate import allowed_text

    declared = f.metadata.get(BOUNDS_KEY)
    if declared is None:
        return ""
    inner, optional = _unwrap(hint)
    origin = typing.get_origin(inner) or inner
    kind = origin if origin in (int, float, str, bool, list, dict) else object
    args = typing.get_args(inner)
    return allowed_text(declared, kind, args[-1] if args else None, optional)


def plugin_schemas(key: str) -> list[tuple[str, type[Any]]]:
    """The schemas a plug-in key's config group names (`conf/<key>/<option>.yaml` `_target_`), by option."""
    import yaml

    found = []
    for path in sorted((REPO / "conf" / key).glob("*.yaml")):
        target = (yaml.safe_load(path.read_text()) or {}).get("_target_")
        if isinstance(target, str):
            module, _, name = target.rpartition(".")
            found.append((path.stem, getattr(importlib.import_module(module), name)))
    return found


def sections(schema: type[Any], prefix: str = "", title: str = "", anchor: str = "job") -> Iterator[Section]:
    """`schema`'s own keys as one section, then each nested schema's, depth first, in field order."""
    hints = typing.get_type_hints(schema)
    docs = attribute_docs(schema)
    entries: list[Entry] = []
    nested: list[tuple[type[Any], str, str, str]] = []
    for f in dataclasses.fields(schema):
        name = user_key(f.name, prefix.rstrip("."))
        key = prefix + name
        inner, _ = _unwrap(hints[f.name])
        if isinstance(inner, type) and dataclasses.is_dataclass(inner):
            nested.append((inner, key, key, key.replace(".", "-")))
        elif inner is Any and not prefix:  # a plug-in (`model`, `data`): the schemas its config group can select
            nested += [(s, key, f"{key}={option}", f"{key}-{option}") for option, s in plugin_schemas(key)]
        else:
            # `_target_` as an id would read as emphasis (`{#model-dlrm-_target_}` shown as written)
            entries.append(Entry(key, f"{anchor}-{name.strip('_')}", type_text(hints[f.name]), default_text(f),
                                 allowed(f, hints[f.name]), docs.get(f.name, "")))
    # the schema's docstring, not its class name: a reader writes keys, not Python (the modules page has those)
    yield Section(title, anchor, inspect.cleandoc(schema.__doc__ or ""), entries)
    for inner, key, sub_title, sub_anchor in nested:
        yield from sections(inner, key + ".", sub_title, sub_anchor)


def config_sections() -> list[Section]:
    """Every section of the config, from the root schema down."""
    from gpujobs.config.schema import JobConfig

    return list(sections(JobConfig))


def _entry_markdown(entry: Entry) -> str:
    facts = [f"type `{entry.type}`", f"default `{entry.default}`"]
    if entry.allowed:
        facts.append(f"allowed: {markdown(entry.allowed)}")
    body = " · ".join(facts) + ("\n\n" + markdown(entry.doc) if entry.doc else "")
    return f"`{entry.key}`{{#{entry.anchor}}}\n:   " + textwrap.indent(body, "    ").lstrip()


def config_page() -> str:
    parts = [
        "# Config keys",
        "Generated from the schemas at build time (`docs/hooks/reference.py`): every key with its type, the "
        "schema's default (the `conf/` groups and `+experiment=rec` set some of these; `--cfg job` prints the "
        "values a command line composes), its declared bounds, checked before anything is submitted, and its "
        "docstring. Every value is also refused when it is a non-finite float or text with a control character.",
    ]
    for section in config_sections():
        title = f"`{section.title}`" if section.title else "Top-level keys"
        parts.append(f"## {title} {{#{section.anchor}}}")
        parts.append(markdown(section.intro))
        parts += [_entry_markdown(entry) for entry in section.entries]
    return "\n\n".join(parts) + "\n"


def help_text(*args: str) -> str:
    """What `gpujobs ARGS...` prints, run as users run it (from the repository, 100 columns wide)."""
    env = {**os.environ, "COLUMNS": "100", "NO_COLOR": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "gpujobs.cli.main", *args], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=120, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"gpujobs {' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()}")
    text = proc.stdout
    # Hydra's help of `submit` goes on to print the whole composed config: the config reference has it
    return text.split("\n== Config ==")[0].rstrip()


def cli_page() -> str:
    from gpujobs.cli.main import COMMANDS, PROG

    with ThreadPoolExecutor() as pool:  # each is a Python start-up: side by side
        helps = list(pool.map(lambda args: help_text(*args), [("--help",), *((n, "--help") for n in COMMANDS)]))
    parts = ["# Commands", "Generated at build time from the registry of subcommands (`gpujobs.cli.main.COMMANDS`) "
             "and each one's own `--help`. Each is also a `python -m` form; see [exit codes](exit-codes.md).",
             f"```text\n{helps[0]}\n```"]
    for (name, command), text in zip(COMMANDS.items(), helps[1:], strict=True):
        parts += [f"## `{PROG} {name}`", markdown(command.summary) + ".", f"```text\n{text}\n```"]
        if "powered by Hydra" in parts[-1]:
            parts.append("Every key it takes is in the [config reference](config.md); Hydra's own flags "
                         "(`--cfg job`, `-m`, `--info`, ...) work as usual.")
    return "\n\n".join(parts) + "\n"


def _exit_docs(target: str) -> str:
    """What the module (or function) behind a command's `module:function` says of its exit codes."""
    module_name, _, function = target.partition(":")
    run = getattr(importlib.import_module(module_name), function)
    for doc in (sys.modules[run.__module__].__doc__ or "", run.__doc__ or ""):
        sentences = re.split(r"(?<=\.)\s+(?=[A-Z`])", " ".join(doc.split()))
        said = [sentence for sentence in sentences if re.search(r"[Ee]xit codes?|\b0 on success", sentence)]
        if said:
            return " ".join(said)
    return ""


def exit_constants() -> list[tuple[str, int, str, str]]:
    """Every module-level `EXIT_* = <int>` of the packages: (name, value, module, its `#:` comment)."""
    found = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            source = path.read_text()
            lines = source.splitlines()
            for node in ast.parse(source).body:
                if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                        and _EXIT.match(node.targets[0].id) and isinstance(node.value, ast.Constant) \
                        and isinstance(node.value.value, int):
                    above = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
                    comment = above[2:].strip() if above.startswith("#:") else ""
                    module = ".".join(path.relative_to(REPO).with_suffix("").parts)
                    found.append((node.targets[0].id, int(node.value.value), module, comment))
    return found


def exit_codes_page() -> str:
    from gpujobs.cli.main import COMMANDS, PROG

    parts = ["# Exit codes", "Generated at build time from the commands' docstrings and the `EXIT_*` constants "
             "of the code. Across commands: `0` done, `1` failed, `2` bad input, refused in one line that names "
             "the key, the value and what is allowed (nothing is queued or half-written)."]
    seen: dict[str, list[str]] = {}
    for name, command in COMMANDS.items():
        seen.setdefault(_exit_docs(command.target), []).append(f"`{PROG} {name}`")
    parts += [f"- {', '.join(names)}: {markdown(text)}" for text, names in seen.items() if text]
    rows = [f"| `{n}` | `{v}` | `{m}` | {cell(c)} |" for n, v, m, c in exit_constants()]
    parts.append("## Constants\n\n| name | value | module | meaning |\n|---|---|---|---|\n" + "\n".join(rows))
    return "\n\n".join(parts) + "\n"


def modules_page() -> str:
    """Every module of the packages with its docstring's first line: the layout, as the code has it."""
    parts = ["# Modules", "Generated at build time: every module with the first line of its docstring. "
             "The packages are layered, every import pointing down (import-linter's contracts in "
             "`pyproject.toml`): `base` → `config` → `rundir` → `backends` → `attempt` → `rank` (the only "
             "one that imports torch) → `launch` → `cli`."]
    for package in PACKAGES:
        rows = []
        for path in sorted((REPO / package).rglob("*.py")):
            summary = (ast.get_docstring(ast.parse(path.read_text())) or "").split("\n\n")[0]
            name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
            rows.append(f"| `{name}` | {cell(summary)} |")
        parts.append(f"## `{package}`\n\n| module | what it is |\n|---|---|\n" + "\n".join(rows))
    return "\n\n".join(parts) + "\n"


def pages() -> dict[str, str]:
    """The generated pages by their path under docs/."""
    return {"reference/config.md": config_page(), "reference/cli.md": cli_page(),
            "reference/exit-codes.md": exit_codes_page(), "reference/modules.md": modules_page()}


def stale_names(text: str, entries: list[Entry]) -> list[str]:
    """The config keys and gpujobs modules that `text`'s code spans name but the code no longer has.

    A span naming a key (`cluster.time`, `+nccl.extra.NCCL_BUFFSIZE=...`, `trainer.balance*`, a section such as
    `logger.mlflow`) must find it among `entries`, a map's entry its map; a span naming a module of a package
    of ours (`gpujobs.rank.srun`) must find its file.
    """
    keys = {entry.key for entry in entries}
    maps = {entry.key for entry in entries if entry.type.startswith("map")}
    sections = {key.split(".")[0] for key in keys if "." in key}
    stale = []
    for name in _NAME_SPAN.findall(text):
        first = name.split(".")[0]
        if first == "gpujobs":
            if not _names_code(name.split(".")):
                stale.append(name)
        elif first in sections:
            prefix = name.rstrip("*")
            known = name in keys or any(k.startswith(prefix if name.endswith("*") else name + ".") for k in keys)
            if not known and not any(name.startswith(m + ".") for m in maps):
                stale.append(name)
    return stale


def _names_code(parts: list[str]) -> bool:
    """Whether `gpujobs.a.b[.name]` is a module, or a name its longest module prefix defines or imports
    (a file of ours written that way, `gpujobs.rules.yml`, is no module name: it passes)."""
    for end in range(len(parts), 1, -1):
        path = REPO.joinpath(*parts[:end])
        source_file = path.with_suffix(".py") if path.with_suffix(".py").is_file() else path / "__init__.py"
        if source_file.is_file():
            if end == len(parts):
                return True
            name = re.escape(parts[end])
            return re.search(rf"^(?:async def|def|class) {name}\b|^{name}\s*[:=]|^(?:from|import) .*\b{name}\b",
                             source_file.read_text(), re.M) is not None
    return not (REPO / "gpujobs" / parts[1]).is_dir()


def on_page_markdown(text: str, page: Any, config: Any, files: Any) -> str:
    """MkDocs event: warn (a failure under --strict) of a config key or module a page names that is gone."""
    for name in stale_names(text, _entries()):
        log.warning("%s names `%s`, which the code no longer has", page.file.src_uri, name)
    return text


def _entries() -> list[Entry]:
    if not _cache:
        _cache.extend(entry for section in config_sections() for entry in section.entries)
    return _cache


def on_files(files: Any, config: Any) -> Any:
    """MkDocs event: add the generated pages to the site's files (before the nav is built)."""
    from mkdocs.structure.files import File

    for uri, text in pages().items():
        files.append(File.generated(config, uri, content=text))
    return files
