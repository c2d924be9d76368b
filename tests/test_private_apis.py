"""The private names of Hydra, OmegaConf and submitit that gpujobs uses, against the installed versions.

`gpujobs.config.hydra_private` (Hydra 1.3.x, OmegaConf 2.3.x) and `gpujobs.backends.submitit_private`
(submitit 1.5.x) hold every use of them and list each in `PRIVATE_NAMES`. Here: the installed versions
are the pinned series; each listed name exists, is of its kind and takes the parameters used (an upgrade
that moves one fails naming it); no private name is used outside the two modules, nor left unlisted in
them. And `one_composition` (a Hydra main composing its config once) gives the config that Hydra's two
compositions give.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import hydra
import pytest
from conftest import REPO
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from gpujobs.backends import submitit_private
from gpujobs.config import hydra_private

#: The series gpujobs is written for: a new one must be checked against `PRIVATE_NAMES`, then pinned here.
PINNED = {"hydra-core": "1.3", "omegaconf": "2.3", "submitit": "1.5"}
MODULES = (hydra_private, submitit_private)
NAMES = [spec for module in MODULES for spec in module.PRIVATE_NAMES]
#: How a module imports a private part of one of the three libraries.
PRIVATE_IMPORT = re.compile(r"^\s*(?:from|import)\s+(hydra\._internal|omegaconf\._|submitit\.(?:core|slurm|local))",
                            re.MULTILINE)
#: The one import of a private name outside the two modules (Hydra's plugin discovery imports its module
#: without gpujobs); `hydra_private.PRIVATE_NAMES` lists it all the same.
ALLOWED_ELSEWHERE = {"hydra_plugins/gpujobs_launcher/gpujobs_sweeper.py":
                     "from hydra._internal.core_plugins.basic_sweeper import BasicSweeper"}


def _parameters(function: Any) -> list[str]:
    return [name for name in inspect.signature(function).parameters if name != "self"]


def _in_order(used: tuple[str, ...], found: list[str]) -> bool:
    """Every used parameter is there, in the order used."""
    at = [found.index(name) for name in used if name in found]
    return len(at) == len(used) and at == sorted(at)


def problem(module: str, dotted: str, kind: str, used: tuple[str, ...]) -> Optional[str]:
    """What is wrong with one private name in the installed library; None when it is as gpujobs uses it."""
    where = f"{module}.{dotted}"
    try:
        owner: Any = importlib.import_module(module)
    except ImportError as err:
        return f"{module} is gone ({err})"
    *path, name = dotted.split(".")
    for part in path:
        owner = getattr(owner, part, None)
        if owner is None:
            return f"{module}.{part} is gone (needed for {where})"
    if kind == "instance attribute":  # set by __init__: read its source, no instance needed
        if not re.search(rf"\bself\.{re.escape(name)}\s*(?::[^=\n]*)?=", inspect.getsource(owner.__init__)):
            return f"{where} is gone: {owner.__name__}.__init__ no longer sets it"
        return None
    try:
        found = inspect.getattr_static(owner, name)
    except AttributeError:
        return f"{where} is gone"
    if kind == "property" and not isinstance(found, property):
        return f"{where} is no longer a property"
    if kind == "class" and not inspect.isclass(found):
        return f"{where} is no longer a class"
    if kind == "function" and not callable(getattr(owner, name)):
        return f"{where} is no longer callable"
    target = found.__init__ if kind == "class" else getattr(owner, name)
    if kind in ("class", "function") and not _in_order(used, params := _parameters(target)):
        return f"{where} takes ({', '.join(params)}), gpujobs passes ({', '.join(used)})"
    return None


@pytest.mark.parametrize("distribution, series", sorted(PINNED.items()))
def test_installed_versions_are_the_pinned_series(distribution: str, series: str) -> None:
    pinned_by = {m.__name__: m.PINNED[distribution] for m in MODULES if distribution in m.PINNED}
    assert pinned_by and set(pinned_by.values()) == {series}, pinned_by
    installed = importlib.metadata.version(distribution)
    assert installed.startswith(f"{series}."), (
        f"{distribution} {installed} is installed; {', '.join(pinned_by)} is written for {series}.x: check its "
        f"PRIVATE_NAMES against this version (this test says which moved), then raise the pin"
    )


@pytest.mark.parametrize("module, dotted, kind, used", NAMES, ids=[f"{m}.{d}" for m, d, _, _ in NAMES])
def test_each_private_name_is_there_as_used(module: str, dotted: str, kind: str, used: tuple[str, ...]) -> None:
    found = problem(module, dotted, kind, used)
    assert found is None, f"{found} (gpujobs uses it; installed: hydra-core " \
        f"{importlib.metadata.version('hydra-core')}, submitit {importlib.metadata.version('submitit')})"


@pytest.mark.parametrize("spec, says", [
    (("submitit", "SlurmJob._no_such_attribute", "attribute", ()), "submitit.SlurmJob._no_such_attribute is gone"),
    (("submitit.core.no_such_module", "f", "function", ()), "submitit.core.no_such_module is gone"),
    (("submitit", "SlurmExecutor._submit_command", "function", ("cmd",)), "takes (command), gpujobs passes (cmd)"),
    (("submitit", "SlurmJob._results_timeout_s", "property", ()), "is no longer a property"),
    (("submitit", "SlurmJob._no_such_field", "instance attribute", ()), "__init__ no longer sets it"),
    (("hydra._internal.config_loader_impl", "get_overrides_dirname", "function", ("kv_sep", "overrides")),
     "gpujobs passes (kv_sep, overrides)"),
])
def test_a_moved_name_is_reported_by_name(spec: tuple[str, str, str, tuple[str, ...]], says: str) -> None:
    found = problem(*spec)
    assert found is not None and says in found, found


def _sources() -> Iterator[tuple[str, str]]:
    for top in ("gpujobs", "hydra_plugins"):
        for path in sorted((REPO / top).rglob("*.py")):
            yield str(path.relative_to(REPO)), path.read_text()


def test_no_private_name_is_used_outside_the_two_modules() -> None:
    own = {str(Path(m.__file__ or "").relative_to(REPO)) for m in MODULES}
    names = {dotted.rsplit(".", 1)[-1] for _, dotted, _, _ in NAMES if dotted.rsplit(".", 1)[-1].startswith("_")}
    attribute = re.compile(rf"\.({'|'.join(sorted(names))})\b|\bdef ({'|'.join(sorted(names))})\b")
    wrong = []
    for name, text in _sources():
        if name in own:
            continue
        allowed = ALLOWED_ELSEWHERE.get(name, "")
        wrong += [f"{name}: {line.strip()}" for line in text.splitlines()
                  if (PRIVATE_IMPORT.match(line) or attribute.search(line)) and line.strip() != allowed]
    assert not wrong, "private names of Hydra/OmegaConf/submitit used outside gpujobs.config.hydra_private and " \
        "gpujobs.backends.submitit_private:\n" + "\n".join(wrong)


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_every_private_name_a_module_uses_is_listed(module: Any) -> None:
    text = Path(module.__file__).read_text()
    listed = {part for _, dotted, _, _ in module.PRIVATE_NAMES for part in dotted.split(".")}
    listed |= {part for m, _, _, _ in module.PRIVATE_NAMES for part in [m, *m.split(".")]}
    used = set(re.findall(r"(?:\.|\bdef |\bimport )(_[a-z]\w*)", text)) - {"__init__"}
    used |= set(re.findall(r"\bfrom ((?:hydra|omegaconf|submitit)[\w.]*) import", text))
    public = {"hydra.core.override_parser.overrides_parser", "hydra.core.override_parser.types", "hydra.types",
              "omegaconf", "submitit.core.utils"}  # (this one's names are listed one by one)
    assert used - listed - public == set(), f"used in {module.__name__} but not in its PRIVATE_NAMES"


# --- one_composition: a Hydra main that composes once gets the config of Hydra's two compositions ---------


def _write_tiny_config(conf: Path) -> Path:
    (conf / "db").mkdir(parents=True)
    (conf / "config.yaml").write_text("defaults:\n  - db: a\n  - _self_\nx: 1\ny: ${x}\nlr: 0.1\n")
    (conf / "db" / "a.yaml").write_text("host: a\n")
    (conf / "db" / "b.yaml").write_text("host: b\n")
    return conf


def _run_main(config_dir: Path, args: list[str], composed_once: bool, monkeypatch: pytest.MonkeyPatch,
              multirun: bool = False) -> tuple[list[str], int]:
    """Run a Hydra main over `config_dir` with `args`; what its task saw (config and Hydra's node, as YAML),
    and how many compositions were made."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    seen: list[str] = []
    calls = []
    compose = ConfigLoaderImpl._load_configuration_impl

    def counted(*args: Any, **kwargs: Any) -> DictConfig:
        calls.append(1)
        return compose(*args, **kwargs)

    monkeypatch.setattr(ConfigLoaderImpl, "_load_configuration_impl", counted)
    monkeypatch.setattr(sys, "argv", ["prog", *args])
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")

    def task(cfg: DictConfig) -> None:
        node = OmegaConf.to_container(HydraConfig.get(), resolve=False)
        seen.append(OmegaConf.to_yaml(cfg) + OmegaConf.to_yaml(node))

    main = hydra.main(version_base="1.3", config_path=str(config_dir), config_name="config")(task)
    if composed_once:
        with hydra_private.one_composition(multirun):
            main()
    else:
        main()
    return seen, len(calls)


@pytest.mark.parametrize("extra", [[], ["db=b", "x=7", "+z=[1,2]"], ["hydra.mode=RUN"], ["hydra.job.chdir=false"]])
def test_a_run_composed_once_sees_what_two_compositions_give(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: list[str]
) -> None:
    conf = _write_tiny_config(tmp_path / "conf")
    args = [f"hydra.run.dir={tmp_path / 'run'}", *extra]
    twice, made_twice = _run_main(conf, args, composed_once=False, monkeypatch=monkeypatch)
    once, made_once = _run_main(conf, args, composed_once=True, monkeypatch=monkeypatch)
    assert (made_twice, made_once) == (2, 1)
    assert once == twice and len(once) == 1


def test_gpujobs_config_composed_once_is_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    args = [f"hydra.run.dir={tmp_path / 'run'}", "+experiment=rec", "+debug=tiny", "cluster=slurm", "optim.lr=0.5"]
    twice, _ = _run_main(REPO / "conf", args, composed_once=False, monkeypatch=monkeypatch)
    once, made = _run_main(REPO / "conf", args, composed_once=True, monkeypatch=monkeypatch)
    assert made == 1 and once == twice


@pytest.mark.parametrize("extra", [["x=1,2"], ["db=nope"], ["lr=${nope}"], ["hydra.mode=MULTIRUN"]])
def test_what_the_run_composition_refuses_or_changes_takes_hydras_own_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: list[str]
) -> None:
    """A sweep without `-m`, an unknown option, a bad interpolation, a config that asks for a multirun: the
    same outcome (error or runs) as Hydra's own probe and run give."""
    conf = _write_tiny_config(tmp_path / "conf")
    outcomes = []
    for once in (False, True):
        args = [f"hydra.run.dir={tmp_path / 'run'}", f"hydra.sweep.dir={tmp_path / f'sweep{once}'}", *extra]
        try:
            seen, _ = _run_main(conf, args, composed_once=once, monkeypatch=monkeypatch)
            outcomes.append(("ran", len(seen)))
        except Exception as err:  # the same error either way is what is checked
            outcomes.append((type(err).__name__, str(err).replace(str(once), "")))
    assert outcomes[0] == outcomes[1]


def test_a_multirun_skips_the_probe_and_runs_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    conf = _write_tiny_config(tmp_path / "conf")
    args = ["-m", f"hydra.sweep.dir={tmp_path / 'sweep'}", "x=1,2"]
    twice, made_twice = _run_main(conf, args, composed_once=False, monkeypatch=monkeypatch, multirun=True)
    once, made_once = _run_main(conf, args, composed_once=True, monkeypatch=monkeypatch, multirun=True)
    assert len(once) == 2 and once == twice
    assert made_once == made_twice - 1  # Hydra's probe, and only it, is spared


def test_hydra_is_as_it_was_after_one_composition() -> None:
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.hydra import Hydra

    before = (Hydra.get_mode, ConfigLoaderImpl.load_configuration)
    with pytest.raises(RuntimeError), hydra_private.one_composition(False):
        raise RuntimeError("the main failed")
    assert (Hydra.get_mode, ConfigLoaderImpl.load_configuration) == before
