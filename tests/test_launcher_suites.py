"""Hydra's own launcher test suites, run against the gpujobs launcher (its blocking, local mode).

The suites run Hydra's toy apps, not gpujobs configs: the launcher must run any Hydra task function.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hydra import version
from hydra.test_utils.launcher_common_tests import IntegrationTestSuite, LauncherTestSuite
from pytest import mark


@pytest.fixture(autouse=True)
def unset_version_base() -> Iterator[None]:
    """The suites expect Hydra's default version base; other tests composing gpujobs' config set 1.3."""
    base = version.VersionBase.instance()
    before = base.version_base
    base.version_base = version._UNSPECIFIED_
    yield
    base.version_base = before


@mark.parametrize("launcher_name, overrides", [("gpujobs", [])])
class TestGpujobsLauncher(LauncherTestSuite):
    """Sweeps of 1 and 2 jobs, strict mode, bad keys, custom resolvers, ..."""


@mark.parametrize(
    "task_launcher_cfg, extra_flags",
    [({"defaults": [{"override hydra/launcher": "gpujobs"}, "_self_"]}, ["-m"])],
)
class TestGpujobsLauncherIntegration(IntegrationTestSuite):
    """Hydra apps run in subprocesses with `-m` and the gpujobs launcher."""
