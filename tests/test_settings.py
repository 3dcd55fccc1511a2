"""Settings: option > environment > ini > default, resolved in one place, each value with its source."""

from __future__ import annotations

import pytest

from pytest_sky import settings
from pytest_sky.resources import Resources
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
    assert s.backend_options() == {"namespace": "from-option"}


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
        (
            {"PYTEST_SKY_BACKEND": "aws"},
            "PYTEST_SKY_BACKEND='aws' is not a backend: use 'local', 'kubernetes' or 'slurm'",
        ),
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
    for name in ("plugin.py", "cli/__init__.py", "cli/commands.py"):
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
    parts = [
        "backend=local (from --backend)",
        "keep_clusters=False (from default)",
        "artifacts=(off) (from default)",
        "artifacts_all=False (from default)",
        "run_timeout=600 (from default)",
        "mtu=9000 (from PYTEST_SKY_MTU)",
    ]
    result.stdout.fnmatch_lines(["pytest-sky: " + ", ".join(parts)])


def test_every_setting_has_an_ini_key_below_the_environment() -> None:
    """Command line > environment > ini > default, for every row of the table."""
    ini = {o.ini: "" for o in settings.OPTIONS}
    ini.update(sky_mtu="1500", sky_keep_clusters="true", sky_run_timeout="30", sky_kube_namespace="from-ini")
    s = resolve(environ={}, ini=ini, ini_file="pytest.ini")
    assert (s.mtu, s.keep_clusters, s.run_timeout, s.kube_namespace) == (1500, True, 30.0, "from-ini")
    assert s.sources["run_timeout"] == "sky_run_timeout in pytest.ini"
    assert "run_timeout=30.0 (from sky_run_timeout in pytest.ini)" in s.describe()
    s = resolve(environ={"PYTEST_SKY_MTU": "9000", "PYTEST_SKY_RUN_TIMEOUT": "45"}, ini=ini, run_timeout="15")
    assert (s.mtu, s.sources["mtu"]) == (9000, "PYTEST_SKY_MTU")
    assert (s.run_timeout, s.sources["run_timeout"]) == (15.0, "--sky-run-timeout")
    assert {o.ini for o in settings.OPTIONS} == {f"sky_{o.name}" for o in settings.OPTIONS}


def test_the_kubernetes_switch_and_a_backend_name_meet_by_level() -> None:
    """A higher level wins whichever of the two it sets; at one level the switch wins."""
    assert resolve(environ={}, ini={"sky_kubernetes": "true", "sky_backend": "local"}).backend == "kubernetes"
    assert resolve(environ={"PYTEST_SKY_BACKEND": "local"}, ini={"sky_kubernetes": "1"}).backend == "local"
    s = resolve(environ={"PYTEST_SKY_KUBERNETES": "1"}, ini={"sky_backend": "local"})
    assert (s.backend, s.sources["backend"]) == ("kubernetes", "PYTEST_SKY_KUBERNETES")


def test_run_timeout_defaults_to_600_seconds_and_0_means_no_deadline() -> None:
    assert resolve(environ={}).run_deadline == settings.DEFAULT_RUN_TIMEOUT == 600
    assert resolve(environ={"PYTEST_SKY_RUN_TIMEOUT": "15"}).run_deadline == 15
    assert resolve(environ={"PYTEST_SKY_RUN_TIMEOUT": "0"}).run_deadline is None
    for bad in ("-5", "inf", "nan", "soon"):
        with pytest.raises(SettingsError) as info:
            resolve(environ={"PYTEST_SKY_RUN_TIMEOUT": bad})
        assert str(info.value) == f"PYTEST_SKY_RUN_TIMEOUT={bad!r} is not a number of seconds (e.g. 600)"


def test_the_ini_file_sets_a_sessions_settings_and_says_so_in_the_header(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    for option in settings.OPTIONS:
        monkeypatch.delenv(option.env, raising=False)
    pytester.makeini("[pytest]\nsky_run_timeout = 30\nsky_mtu = 1500\n")
    pytester.makepyfile(test_inner="def test_nothing():\n    pass\n")
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        ["*run_timeout=30.0 (from sky_run_timeout in tox.ini)*mtu=1500 (from sky_mtu in tox.ini)*"]
    )
    monkeypatch.setenv("PYTEST_SKY_RUN_TIMEOUT", "45")
    result = pytester.runpytest_subprocess("--sky-mtu", "9000")
    result.stdout.fnmatch_lines(["*run_timeout=45.0 (from PYTEST_SKY_RUN_TIMEOUT)*mtu=9000 (from --sky-mtu)*"])
    pytester.makeini("[pytest]\nsky_run_timeout = soon\n")
    monkeypatch.delenv("PYTEST_SKY_RUN_TIMEOUT")
    result = pytester.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*sky_run_timeout in tox.ini='soon' is not a number of seconds (e.g. 600)"])


def test_a_tasks_infra_picks_the_backend_unless_the_command_line_did() -> None:
    k8s = Resources(infra="k8s/team-a")
    placed, notes = resolve(environ={}).for_task(k8s)
    assert (placed.backend, placed.kube_context, notes) == ("kubernetes", "team-a", [])
    assert placed.sources["backend"] == placed.sources["kube_context"] == settings.TASK_SOURCE
    assert "backend=kubernetes (from the task's resources)" in placed.describe()
    # The command line (or its environment twin) has the last word, and says so.
    placed, notes = resolve(backend="local", environ={}).for_task(k8s)
    assert placed.backend == "local"
    assert notes == ["the task asks for infra kubernetes; it runs on local, as --backend says"]
    placed, _ = resolve(kube_context="mine", environ={"PYTEST_SKY_BACKEND": "kubernetes"}).for_task(k8s)
    assert (placed.backend, placed.kube_context) == ("kubernetes", "mine")
    # infra: local runs here even when the environment would not have said so otherwise.
    assert resolve(environ={}).for_task(Resources(infra="local"))[0].backend == "local"


def test_image_id_is_the_pod_image_on_kubernetes_and_a_note_locally() -> None:
    image = Resources(image_id="docker:python:3.11-slim")
    placed, notes = resolve(kubernetes=True, environ={}).for_task(image)
    assert (placed.kube_image, notes) == ("python:3.11-slim", [])
    assert placed.backend_options()["image"] == "python:3.11-slim"
    placed, notes = resolve(kubernetes=True, kube_image="ours:1", environ={}).for_task(image)
    assert placed.kube_image == "ours:1"
    assert notes == ["the task's image_id docker:python:3.11-slim is not used: --kube-image chose the image"]
    placed, notes = resolve(environ={}).for_task(image)
    assert placed.backend == "local"
    assert notes == [
        "image_id docker:python:3.11-slim has no effect on the local backend: nodes run this machine's software"
    ]


def test_kube_timeout_comes_from_its_environment_twin_only_here() -> None:
    s = resolve(kubernetes=True, environ={"PYTEST_SKY_KUBE_TIMEOUT": "45"})
    assert s.backend_options()["ready_timeout"] == 45.0
    with pytest.raises(SettingsError, match=r"^PYTEST_SKY_KUBE_TIMEOUT='soon' is not a number of seconds"):
        resolve(environ={"PYTEST_SKY_KUBE_TIMEOUT": "soon"})


def test_no_module_but_settings_reads_an_environment_twin() -> None:
    """Settings resolve in one place: no other module reads a PYTEST_SKY_* variable itself."""
    import pathlib
    import re

    reads = re.compile(r"""environ(?:\.get)?[(\[]\s*(?:["']PYTEST_SKY_|[A-Z_]*ENV\b)""")
    root = pathlib.Path(settings.__file__).parent
    readers = [
        str(p.relative_to(root)) for p in root.rglob("*.py") if p.name != "settings.py" and reads.search(p.read_text())
    ]
    assert readers == []


def test_the_header_shows_the_value_a_default_stands_for() -> None:
    """A new user reads the report header: an unset setting shows what it means, not None."""
    assert "mtu=65535 (from default)" in resolve(environ={}).describe()
    kube = resolve(kubernetes=True, environ={}).describe()
    assert "kube_image=python:3.11-slim-bookworm (from default)" in kube
    assert "kube_context=(kubeconfig's) (from default)" in kube


def test_the_gpu_label_has_an_option_an_environment_twin_and_a_header_line() -> None:
    s = resolve(kubernetes=True, environ={"PYTEST_SKY_KUBE_GPU_LABEL": "cloud.google.com/gke-accelerator"})
    assert s.backend_options()["gpu_label"] == "cloud.google.com/gke-accelerator"
    assert "kube_gpu_label=cloud.google.com/gke-accelerator (from PYTEST_SKY_KUBE_GPU_LABEL)" in s.describe()
    s = resolve(kubernetes=True, kube_gpu_label="example.com/gpu", environ={"PYTEST_SKY_KUBE_GPU_LABEL": "x"})
    assert (s.kube_gpu_label, s.sources["kube_gpu_label"]) == ("example.com/gpu", "--kube-gpu-label")
    assert (
        "kube_gpu_label=(the nodes' known GPU label, else nvidia.com/gpu.product) (from default)"
        in resolve(kubernetes=True, environ={}).describe()
    )


def test_every_row_of_the_table_is_a_pytest_option_a_cli_flag_and_an_environment_twin(
    pytester: pytest.Pytester, capsys: pytest.CaptureFixture[str]
) -> None:
    """One table makes them all: a setting added there shows up everywhere with its twin named."""
    from pytest_sky.cli import main

    help_text = pytester.runpytest_subprocess("--help").stdout.str()
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["launch", "--help"])
    launch = capsys.readouterr().out
    for option in settings.OPTIONS:
        assert option.flag in help_text and f"[{option.env}]" in help_text, option.name
        assert (option.flag in launch) == option.on_cli, option.name


def test_kube_timeout_is_an_option_too_and_reaches_the_backend() -> None:
    s = resolve(kubernetes=True, kube_timeout="90", environ={})
    assert s.backend_options() == {"ready_timeout": 90.0}
    assert "kube_timeout=90.0 (from --kube-timeout)" in s.describe()
    with pytest.raises(SettingsError) as info:
        resolve(environ={"PYTEST_SKY_KUBE_TIMEOUT": "soon"})
    assert str(info.value) == "PYTEST_SKY_KUBE_TIMEOUT='soon' is not a number of seconds (e.g. 600)"


def test_a_clusters_lease_and_its_pods_max_lifetime_are_settings_the_header_shows() -> None:
    default = resolve(kubernetes=True, environ={}).describe()
    assert "kube_max_lifetime=21600 (6 h; kept clusters: none) (from default)" in default
    assert "kube_lease_seconds=120 (from default)" in default
    s = resolve(
        kubernetes=True,
        kube_max_lifetime="3600",
        environ={"PYTEST_SKY_KUBE_LEASE_SECONDS": "30"},
    )
    assert s.backend_options() == {"lease_seconds": 30.0, "max_lifetime": 3600.0}
    assert "kube_max_lifetime=3600.0 (from --kube-max-lifetime)" in s.describe()
    assert "kube_lease_seconds=30.0 (from PYTEST_SKY_KUBE_LEASE_SECONDS)" in s.describe()


def test_the_header_shows_only_the_chosen_backends_settings() -> None:
    local = resolve(environ={}).describe()
    kube = resolve(backend="k8s", environ={}).describe()
    assert "mtu=65535" in local and "kube_" not in local
    assert "mtu" not in kube and "kube_image=python:3.11-slim-bookworm (from default)" in kube
    assert "backend=kubernetes (from --backend)" in kube


def test_the_registry_is_the_one_list_of_backends() -> None:
    from pytest_sky import registry

    assert registry.names() == ("local", "kubernetes", "slurm")
    assert registry.spellings() == ("local", "kubernetes", "slurm", "k8s")
    assert registry.canonical("k8s") == "kubernetes"
    assert resolve(environ={"PYTEST_SKY_BACKEND": "k8s"}).backend == "kubernetes"


def test_a_backend_whose_client_is_not_installed_is_one_line_naming_the_package(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without its client a backend is refused before its module is imported, not with a
    ``ModuleNotFoundError`` from deep inside a launch."""
    from pytest_sky import registry
    from pytest_sky.backends import get_backend
    from pytest_sky.errors import BackendUnavailableError

    missing = registry.BackendEntry(
        "faraway", (), "pytest_sky.backends.never:Never", "nodes elsewhere", needs=(("no_such_client", "no-such>=1"),)
    )
    monkeypatch.setattr(registry, "BACKENDS", (*registry.BACKENDS, missing))
    with pytest.raises(BackendUnavailableError) as info:
        get_backend("faraway")
    assert str(info.value) == (
        "the faraway backend needs the Python package 'no_such_client', which is not installed "
        "in this environment: pip install 'no-such>=1'"
    )
    with pytest.raises(BackendUnavailableError) as info:
        get_backend("nowhere")
    assert str(info.value) == "unknown backend 'nowhere': choose one of local, kubernetes, slurm, faraway, k8s"


def test_a_backends_missing_client_is_named_with_the_range_ci_tests() -> None:
    """The requirement the one-line error names is pyproject's own (the client majors CI
    runs the Kubernetes stage on, lowest and highest), not a second spelling of it."""
    from pathlib import Path

    from pytest_sky import registry

    pyproject = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()  # no tomllib on 3.10
    for entry in registry.BACKENDS:
        for _, requirement in entry.needs:
            assert f'"{requirement}",' in pyproject, requirement
