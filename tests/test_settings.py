"""Settings: option > environment > default, resolved in one place, each value with its source."""

from __future__ import annotations

import pytest

from pytest_sky import settings
from pytest_sky.settings import SettingsError, resolve


def test_defaults_when_nothing_is_given() -> None:
    s = resolve(environ={})
    assert (s.backend, s.keep_clusters, s.mtu, s.kube_context) == ("local", False, None, None)
    assert s.sources == {}
    assert "backend=local (from default)" in s.describe()


def test_environment_twin_applies_and_is_named_as_the_source() -> None:
    s = resolve(environ={"PYTEST_SKY_MTU": "9000", "PYTEST_SKY_KEEP_CLUSTERS": "yes"})
    assert (s.mtu, s.keep_clusters) == (9000, True)
    assert s.sources == {"mtu": "PYTEST_SKY_MTU", "keep_clusters": "PYTEST_SKY_KEEP_CLUSTERS"}
    assert "mtu=9000 (from PYTEST_SKY_MTU)" in s.describe()


def test_option_wins_over_environment() -> None:
    env = {"PYTEST_SKY_BACKEND": "kubernetes", "PYTEST_SKY_KUBE_NAMESPACE": "from-env"}
    s = resolve(backend="local", environ=env)
    assert (s.backend, s.sources["backend"]) == ("local", "--backend")
    s = resolve(kube_namespace="from-option", environ=env)
    assert (s.backend, s.sources["backend"]) == ("kubernetes", "PYTEST_SKY_BACKEND")
    assert (s.kube_namespace, s.sources["kube_namespace"]) == ("from-option", "--kube-namespace")
    assert s.backend_options() == {"context": None, "namespace": "from-option", "image": None}


def test_kubernetes_switch_wins_over_a_backend_name_at_each_level() -> None:
    assert resolve(kubernetes=True, backend="local", environ={}).backend == "kubernetes"
    s = resolve(environ={"PYTEST_SKY_KUBERNETES": "1", "PYTEST_SKY_BACKEND": "local"})
    assert (s.backend, s.sources["backend"]) == ("kubernetes", "PYTEST_SKY_KUBERNETES")
    # ... but an option on the command line beats any environment.
    assert resolve(backend="local", environ={"PYTEST_SKY_KUBERNETES": "1"}).backend == "local"
    assert resolve(environ={"PYTEST_SKY_BACKEND": "k8s"}).backend == "kubernetes"


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"PYTEST_SKY_BACKEND": "aws"}, "PYTEST_SKY_BACKEND='aws' is not a backend: use 'local' or 'kubernetes'"),
        ({"PYTEST_SKY_MTU": "big"}, "PYTEST_SKY_MTU='big' is not a whole number (e.g. 65535)"),
    ],
)
def test_bad_values_are_one_line_errors(environ: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError) as info:
        resolve(environ=environ)
    assert str(info.value) == message


def test_only_this_module_reads_the_plugins_environment_twins() -> None:
    """The plugin and the CLI hand their options to settings.resolve; neither reads PYTEST_SKY_* itself."""
    from pathlib import Path

    package = Path(settings.__file__).parent
    for name in ("plugin.py", "cli.py"):
        text = (package / name).read_text()
        assert "os.environ.get(ENV_PREFIX" not in text and 'environ.get("PYTEST_SKY_BACKEND' not in text, name


def test_report_header_shows_each_setting_and_its_source(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(test_inner="def test_nothing():\n    pass\n")
    monkeypatch.setenv("PYTEST_SKY_MTU", "9000")
    monkeypatch.delenv("PYTEST_SKY_BACKEND", raising=False)
    monkeypatch.delenv("PYTEST_SKY_KUBERNETES", raising=False)
    monkeypatch.delenv("PYTEST_SKY_KEEP_CLUSTERS", raising=False)
    result = pytester.runpytest_subprocess("--backend", "local")
    result.assert_outcomes(passed=1)
    parts = ["backend=local (from --backend)", "keep_clusters=False (from default)", "mtu=9000 (from PYTEST_SKY_MTU)"]
    result.stdout.fnmatch_lines(["pytest-sky: " + ", ".join(parts)])
