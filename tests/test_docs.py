"""The docs follow the code: the generated config reference lists exactly the keys `--cfg job` prints, each
with the bounds its schema declares; the README is short and its links lead somewhere; the README and the
pages name only config keys and modules the code has.

The site itself is built once, by scripts/test.sh (`mkdocs build --strict`: a broken link or a missing page
fails it); these tests call the same generator (docs/hooks/reference.py) without building.
"""

from __future__ import annotations

import dataclasses
import importlib.util
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
