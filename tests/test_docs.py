"""The docs follow the code: the generated config reference lists exactly the keys `--cfg job` prints, each
with the bounds its schema declares; the README is short and its links lead somewhere; the README and the
pages name only config keys and modules the code has.

scripts/test.sh builds the site (`mkdocs build --strict`: a broken link or a missing page fails it); most
tests call the same generator (docs/hooks/reference.py) without building, and the `site` ones read a real
`mkdocs build --strict` of it: what a reader sees, not what the generator meant.
"""

from __future__ import annotations

import ast
import dataclasses
import html
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from conftest import REPO, compose_job

from gpujobs.config.validate import declared

README = REPO / "README.md"
# The rec experiment as the README runs it, and the options it does not select: the Kubernetes cluster's keys,
# the other data source, both trackers and a bring-your-own script, so that together they print every key a
# schema has.
REC = ("+experiment=rec",)
OTHERS = ("+experiment=rec", "cluster=kubernetes", "data=criteo", "model=dcnv2", "logger=[tensorboard,mlflow]",
          "+script.path=train.py", "+script.args=[]", "+script.cwd=null")


def load_generator() -> ModuleType:
    """docs/hooks/reference.py, the MkDocs hook (docs/ is no package)."""
    spec = importlib.util.spec_from_file_location("docs_reference", REPO / "docs" / "hooks" / "reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def config_page() -> str:
    return str(load_generator().config_page())


def flat_keys(tree: Any, prefix: str = "") -> set[str]:
    """The dotted keys of a YAML mapping's leaves; an empty mapping is a leaf (`nccl.extra: {}`)."""
    if not isinstance(tree, dict) or not tree:
        return {prefix.rstrip(".")}
    return set().union(*(flat_keys(value, f"{prefix}{key}.") for key, value in tree.items()))


def cfg_job_keys(*overrides: str) -> set[str]:
    """Every key `python -m gpujobs.submit OVERRIDES --cfg job` prints."""
    proc = subprocess.run([sys.executable, "-m", "gpujobs.submit", *overrides, "--cfg", "job"], capture_output=True,
                          text=True, cwd=REPO, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return flat_keys(yaml.safe_load(proc.stdout))


def entries(page: str) -> dict[str, list[str]]:
    """The page's entries by key: each key's definition text (a key may have one per schema: `data.seed`)."""
    found: dict[str, list[str]] = {}
    for match in re.finditer(r"^`([^`]+)`\{#[^}]+\}\n:   (.*?)(?=\n\n`[^`]+`\{#|\n\n## |\Z)", page, re.M | re.S):
        found.setdefault(match.group(1), []).append(match.group(2))
    return found


def test_the_config_reference_lists_every_key_of_cfg_job_and_no_other(config_page: str) -> None:
    printed = cfg_job_keys(*REC) | cfg_job_keys(*OTHERS)
    # a section printed empty in one (`logger: {}`) and with keys in the other is no key of its own
    printed = {key for key in printed if not any(other.startswith(key + ".") for other in printed)}
    listed = set(entries(config_page))
    assert printed - listed == set(), "keys --cfg job prints that the reference does not list"
    assert listed - printed == set(), "keys the reference lists that no --cfg job prints"


def owner(job: Any, key: str) -> tuple[Any, str]:
    """The schema object holding `key` in a loaded job, and the key's field name in it."""
    *path, leaf = key.split(".")
    obj = job
    for part in path:
        obj = getattr(obj, part)
    names = {f.name for f in dataclasses.fields(obj)}
    return obj, leaf if leaf in names else f"{leaf}_"  # `checkpoint.async` is the field `async_`


def bound_words(bounds: Any) -> list[str]:
    """What a reader of the entry must find of these bounds: each limit, choice, text and note."""
    words = [str(limit) for limit in (bounds.ge, bounds.gt, bounds.le, bounds.lt) if limit is not None]
    words += list(bounds.one_of)
    words += [text for text in (bounds.allowed, bounds.note) if text]
    return words


def test_every_declared_bound_is_in_its_keys_entry(config_page: str, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    jobs = [compose_job(*REC), compose_job("+experiment=rec", "data=criteo", "data.train_files=a", "data.store=/s",
                                           "model=dcnv2", "logger=[tensorboard,mlflow]", f"+script.path={script}")]
    listed, markdown, checked = entries(config_page), load_generator().markdown, 0
    for key, texts in listed.items():
        for job in jobs:
            try:
                obj, name = owner(job, key)
            except (AttributeError, TypeError):
                continue  # a key of the option this job does not select
            bounds = declared(type(obj)).get(name)
            if bounds is not None:
                missing = [word for word in bound_words(bounds) if not any(markdown(word) in t for t in texts)]
                assert missing == [], f"{key}: its entry does not say {missing}"
                checked += 1
    assert checked > 80  # most keys declare bounds: the walk found them


def test_the_readme_is_short_and_its_links_lead_somewhere() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    local = [link.split("#")[0] for link in links if not re.match(r"[a-z]+://", link) and not link.startswith("#")]
    assert local, "the README links into the site"
    assert [link for link in local if not (REPO / link).exists()] == []



def test_the_pages_and_the_readme_name_only_keys_and_modules_the_code_has() -> None:
    generator = load_generator()
    known = [entry for section in generator.config_sections() for entry in section.entries]
    sample = ("`cluster.tiem` `cluster.time=1:30` `+nccl.extra.NCCL_BUFFSIZE=1` `trainer.balance*` `logger.mlflow` "
              "`gpujobs.rank.nope` `gpujobs.rank.srun RUN_DIR` `gpujobs.cli.main.COMMANDS` `gpujobs.cli.main.NOPE`")
    assert generator.stale_names(sample, known) == ["cluster.tiem", "gpujobs.rank.nope", "gpujobs.cli.main.NOPE"]
    written = [README, *sorted((REPO / "docs").rglob("*.md"))]
    stale = {str(p.relative_to(REPO)): names for p in written if (names := generator.stale_names(p.read_text(), known))}
    assert stale == {}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site as `mkdocs build --strict` makes it (its reference pages generated from the code)."""
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stderr
    return out


def shown(page: Path) -> str:
    """A built page's text as a reader sees it: its article, tags dropped, entities read."""
    body = page.read_text()
    body = body[body.find("<article"):body.find("</article>")]
    return html.unescape(re.sub(r"<[^>]+>", "", body))


def our_names() -> tuple[set[str], set[str]]:
    """The names a reader should never meet in the reference: the module-level classes and constants of our
    packages written as code is (`SyntheticClicksConfig`, `MAX_WAIT_S`, `_MEM_GB`), not as words are; and every
    class name, which `Backend.follows` names an attribute of."""
    names, classes = set(), set()
    for package in ("gpujobs", "jobs", "hydra_plugins"):
        for path in (REPO / package).rglob("*.py"):
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.ClassDef):
                    classes.add(node.name)
                targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
                names.update(t.id for t in targets if isinstance(t, ast.Name))
    camel = re.compile(r"(?:[A-Z][a-z0-9]+){2,}")
    names = {n for n in names | classes if n.startswith("_") or ("_" in n and n.isupper()) or camel.fullmatch(n)}
    return names, classes


def test_the_built_site_shows_no_attribute_list_as_text(site: Path) -> None:
    """`model._target_{#model-dlrm-target}` was a heading's text: an id that Markdown read as emphasis."""
    pages = sorted(site.rglob("*.html"))
    assert len(pages) > 20
    shows = [str(page.relative_to(site)) for page in pages if "{#" in shown(page)]
    assert shows == []


def test_the_reference_names_no_internal_names(site: Path) -> None:
    """The config, command and exit-code pages speak of keys, commands and values: no class or constant of the
    code (a `_target_`'s value names its schema, as `--cfg job` prints it: that is a value, and stays)."""
    names, classes = our_names()
    assert {"SyntheticClicksConfig", "MAX_WAIT_S", "_MEM_GB"} <= names and "Backend" in classes  # the walk sees them
    leaks = {}
    for page in ("config", "cli"):
        text = shown(site / "reference" / page / "index.html")
        text = re.sub(r"default (?:jobs|gpujobs)\.[\w.]+", "", text)  # a _target_'s value
        words = set(re.findall(r"\b_?[A-Za-z][A-Za-z0-9_]*", text))
        dotted = set(re.findall(r"\b([A-Z]\w+)\.[a-z_]\w*", text))
        found = sorted((words & names) - {"_target_"}) + sorted(dotted & classes)
        if found:
            leaks[page] = found
    assert leaks == {}


def test_the_reference_names_every_key_command_and_exit_code(site: Path) -> None:
    from gpujobs.cli.main import COMMANDS, PROG

    config = shown(site / "reference" / "config" / "index.html")
    printed = cfg_job_keys(*REC) | cfg_job_keys(*OTHERS)
    printed = {key for key in printed if not any(other.startswith(key + ".") for other in printed)}
    assert sorted(key for key in printed if key not in config) == []
    cli = shown(site / "reference" / "cli" / "index.html")
    assert [name for name in COMMANDS if f"{PROG} {name}" not in cli] == []
    exits = shown(site / "reference" / "exit-codes" / "index.html")
    rows = re.findall(r"^(EXIT_[A-Z_]+)\s*\n?\s*(\d+)\s*\n?\s*([\w.]+)\s*\n?(.*)$", exits, re.M)
    constants = {f"{name} {module}": meaning.strip() for name, _, module, meaning in rows}
    assert {"EXIT_BAD_INPUT gpujobs.cli.main", "EXIT_REFUSED gpujobs.cli.submit"} <= set(constants), exits
    assert [row for row, meaning in constants.items() if not meaning] == []  # each says what it means
    assert "143 SIGTERM" in exits and "130 Ctrl-C" in exits, exits  # an interrupted launcher's 128 + N


def test_the_home_page_maps_every_guide_and_concept_of_the_site() -> None:
    """index.md's site map links every page the nav lists under Guides and Concepts (it left out the
    containers, Kubernetes and Criteo guides)."""
    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]
    listed = [page for part in nav if isinstance(part, dict) for title, pages in part.items()
              if title in ("Guides", "Concepts") for entry in pages for page in entry.values()]
    assert len(listed) > 15
    site_map = (REPO / "docs" / "index.md").read_text().split("## This site", 1)[1]
    assert [page for page in listed if f"]({page})" not in site_map] == []


def test_no_page_speaks_of_how_the_project_was_made() -> None:
    """The README and the site speak of gpujobs, not of the work that made it (issues, sessions, who was lent
    what)."""
    making = re.compile(r"\b(?:issue \d+|sessions?|no task so far|was lent|(?:the )?lead engineer)\b", re.I)
    said = {str(p.relative_to(REPO)): found for p in [README, *sorted((REPO / "docs").rglob("*.md"))]
            if (found := making.findall(p.read_text()))}
    assert said == {}
