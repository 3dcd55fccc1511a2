from __future__ import annotations

import math

import pytest

from pytest_sky.errors import ResourcesError, TaskError
from pytest_sky.resources import Accelerator, Resources, parse_accelerators


def assert_one_line(err: pytest.ExceptionInfo[BaseException], *needles: str) -> str:
    """Errors are printed without a traceback, so the line itself must say it all."""
    message = str(err.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    return message


# --- Accelerator and parse_accelerators -----------------------------------------------


@pytest.mark.parametrize(
    ("value", "name", "count"),
    [
        ("V100", "V100", 1),
        ("V100:2", "V100", 2),
        ("V100:0.5", "V100", 0.5),
        (" A100:8 ", "A100", 8),
        ("tpu-v4_8.x:4", "tpu-v4_8.x", 4),
        ({"A100": 8}, "A100", 8),
        ({"V100": 0.5}, "V100", 0.5),
        ({"V100": "2"}, "V100", 2),
        # YAML reads the flow form `{A100:8}` as {"A100:8": None}
        ({"A100:8": None}, "A100", 8),
        ("V100:1024", "V100", 1024),
    ],
)
def test_parse_accelerators_accepts_skypilot_forms(value: object, name: str, count: float) -> None:
    assert parse_accelerators(value) == Accelerator(name, count)


def test_parse_accelerators_none_means_no_request() -> None:
    assert parse_accelerators(None) is None


@pytest.mark.parametrize(
    "value",
    [
        "",
        "   ",
        "V100:abc",
        "V100:",
        "V100:0",
        "V100:-1",
        "V100:1.5",
        "V100:2.25",
        "V100:nan",
        "V100:inf",
        "V100:1e3",
        "V100:2000",
        "V100:1:2",
        "V 100",
        "V100!:1",
        ":2",
        {"V100": 0},
        {"V100": -2},
        {"V100": 1.5},
        {"V100": math.nan},
        {"V100": math.inf},
        {"V100": True},
        {"V100": [1]},
        {"V100": 10**400},
        {"A100": 8, "V100": 1},
        {},
        {1: 2},
        True,
        False,
        ["V100"],
        8,
        0.5,
    ],
)
def test_parse_accelerators_rejects_invalid(value: object) -> None:
    with pytest.raises(ResourcesError) as err:
        parse_accelerators(value)
    # names the key and shows a form that works
    assert_one_line(err, "resources.accelerators", "V100:2")


def test_parse_accelerators_names_the_callers_key() -> None:
    with pytest.raises(ResourcesError) as err:
        parse_accelerators("V100:0", key="gpus")
    assert_one_line(err, "gpus", "'V100:0'")


@pytest.mark.parametrize(
    ("accelerator", "text"),
    [
        (Accelerator("V100", 0.5), "V100:0.5"),
        (Accelerator("A100", 8), "A100:8"),
        (Accelerator("A100", 8.0), "A100:8"),
        (Accelerator("V100", 1), "V100:1"),
        (Accelerator("V100", 0.25), "V100:0.25"),
    ],
)
def test_accelerator_str_is_the_requested_form(accelerator: Accelerator, text: str) -> None:
    assert str(accelerator) == text
    assert parse_accelerators(text) == accelerator


@pytest.mark.parametrize(("count", "ceiling"), [(0.5, 1), (0.01, 1), (1, 1), (2, 2), (8.0, 8)])
def test_per_node_ceiling_rounds_fractions_up(count: float, ceiling: int) -> None:
    assert Accelerator("V100", count).per_node_ceiling() == ceiling


@pytest.mark.parametrize(("name", "count"), [("V100", 0), ("V100", 1.5), ("bad name", 1), ("V100", True)])
def test_accelerator_cannot_be_built_invalid(name: str, count: float) -> None:
    with pytest.raises(ResourcesError):
        Accelerator(name, count)


# --- Resources.from_dict --------------------------------------------------------------


def test_from_dict_reads_all_keys() -> None:
    resources = Resources.from_dict(
        {
            "cpus": "2+",
            "memory": 8,
            "accelerators": "V100:0.5",
            "infra": "K8s",
            "image_id": "docker:python:3.11",
        }
    )
    assert resources == Resources(
        cpus=2,
        memory=8,
        accelerators=Accelerator("V100", 0.5),
        infra="kubernetes",
        image_id="docker:python:3.11",
    )


def test_from_dict_none_and_empty_ask_for_nothing() -> None:
    assert Resources.from_dict(None) == Resources()
    assert Resources.from_dict({}) == Resources()
    assert Resources.from_dict({"cpus": None}) == Resources()


@pytest.mark.parametrize(
    ("value", "expected"),
    [(2, 2.0), (0.5, 0.5), ("2", 2.0), ("4+", 4.0), (" 4+ ", 4.0), ("1.5", 1.5)],
)
def test_cpus_forms(value: object, expected: float) -> None:
    assert Resources.from_dict({"cpus": value}).cpus == expected


@pytest.mark.parametrize(("value", "expected"), [(16, 16.0), ("32+", 32.0), (0.5, 0.5)])
def test_memory_forms(value: object, expected: float) -> None:
    assert Resources.from_dict({"memory": value}).memory == expected


@pytest.mark.parametrize(
    ("d", "infra", "context"),
    [
        ({"infra": "local"}, "local", None),
        ({"infra": "LOCAL"}, "local", None),
        ({"infra": "kubernetes"}, "kubernetes", None),
        ({"infra": "k8s"}, "kubernetes", None),
        ({"cloud": "k8s"}, "kubernetes", None),
        ({"infra": "k8s/my-Context"}, "kubernetes", "my-Context"),
        ({"infra": "kubernetes/arn:aws:eks:x/y"}, "kubernetes", "arn:aws:eks:x/y"),
        ({"infra": "k8s", "cloud": "kubernetes"}, "kubernetes", None),
        # SkyPilot's other clouds are accepted (the task runs on the selected backend, noted).
        ({"infra": "aws"}, "aws", None),
        ({"infra": "AWS/us-east-1/us-east-1a"}, "aws", None),
        ({"cloud": "gcp"}, "gcp", None),
    ],
)
def test_infra_is_normalised(d: dict[str, object], infra: str, context: str | None) -> None:
    resources = Resources.from_dict(d)
    assert resources.infra == infra
    assert resources.infra_context == context


@pytest.mark.parametrize(
    ("d", "key"),
    [
        ({"cpus": 0}, "resources.cpus"),
        ({"cpus": -1}, "resources.cpus"),
        ({"cpus": "many"}, "resources.cpus"),
        ({"cpus": "+"}, "resources.cpus"),
        ({"cpus": "4++"}, "resources.cpus"),
        ({"cpus": True}, "resources.cpus"),
        ({"cpus": math.nan}, "resources.cpus"),
        ({"cpus": math.inf}, "resources.cpus"),
        ({"cpus": 2048}, "resources.cpus"),
        ({"cpus": [2]}, "resources.cpus"),
        ({"memory": 0}, "resources.memory"),
        ({"memory": "8GB"}, "resources.memory"),
        ({"memory": 10**6}, "resources.memory"),
        ({"accelerators": "V100:1.5"}, "resources.accelerators"),
        ({"infra": "awss"}, "resources.infra"),
        ({"infra": 3}, "resources.infra"),
        ({"infra": "local/ctx"}, "resources.infra"),
        ({"infra": "k8s/"}, "resources.infra"),
        ({"infra": "k8s/my ctx"}, "resources.infra"),
        ({"cloud": "gpc"}, "resources.cloud"),
        ({"infra": "k8s", "cloud": "local"}, "resources.cloud"),
        ({"image_id": ""}, "resources.image_id"),
        ({"image_id": {"us-east-1": "ami-1"}}, "resources.image_id"),
    ],
)
def test_from_dict_rejects_invalid_values(d: dict[str, object], key: str) -> None:
    with pytest.raises(ResourcesError) as err:
        Resources.from_dict(d)
    assert_one_line(err, key)


def test_unknown_infra_lists_known_values() -> None:
    with pytest.raises(ResourcesError) as err:
        Resources.from_dict({"infra": "kuberntes"})
    assert_one_line(err, "'kuberntes'", "local", "kubernetes", "k8s", "did you mean 'kubernetes'?")


def test_from_dict_unknown_key_lists_allowed_and_suggests() -> None:
    with pytest.raises(ResourcesError) as err:
        Resources.from_dict({"gpus": "V100"})
    assert_one_line(
        err,
        "'gpus'",
        "accelerators, any_of, cloud, cpus, disk_size, image_id, infra, instance_type, job_recovery, labels, "
        "memory, ordered, ports, use_spot",
        "did you mean 'accelerators'?",
    )


def test_from_dict_rejects_non_mapping() -> None:
    with pytest.raises(ResourcesError) as err:
        Resources.from_dict(["cpus", 2])  # type: ignore[arg-type]
    assert_one_line(err, "resources", "['cpus', 2]")


def test_from_dict_uses_where_in_messages() -> None:
    with pytest.raises(ResourcesError) as err:
        Resources.from_dict({"cpus": 0}, where="marker resources")
    assert_one_line(err, "marker resources.cpus")


def test_resources_error_is_a_task_error() -> None:
    with pytest.raises(TaskError):
        Resources.from_dict({"cpus": 0})


def test_direct_construction_is_validated_and_normalised() -> None:
    assert Resources(cpus=2, infra="K8S/ctx") == Resources(cpus=2.0, infra="kubernetes", infra_context="ctx")
    with pytest.raises(ResourcesError):
        Resources(cpus=0)
    with pytest.raises(ResourcesError):
        Resources(infra_context="ctx")


# --- from_kwargs ----------------------------------------------------------------------


def test_from_kwargs_gpus_is_an_alias_of_accelerators() -> None:
    assert Resources.from_kwargs(gpus="V100:2") == Resources.from_kwargs(accelerators="V100:2")
    assert Resources.from_kwargs(gpus="V100:2").accelerators == Accelerator("V100", 2)


def test_from_kwargs_reads_cpus_and_memory() -> None:
    assert Resources.from_kwargs(cpus="4+", memory=16) == Resources(cpus=4, memory=16)
    assert Resources.from_kwargs() == Resources()


def test_from_kwargs_rejects_both_aliases() -> None:
    with pytest.raises(ResourcesError) as err:
        Resources.from_kwargs(gpus="V100", accelerators="A100")
    assert_one_line(err, "gpus", "accelerators", "'V100'", "'A100'")


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"gpus": "V100:0"}, "gpus"),
        ({"accelerators": 2}, "accelerators"),
        ({"cpus": 0}, "cpus"),
        ({"memory": "lots"}, "memory"),
    ],
)
def test_from_kwargs_names_the_argument(kwargs: dict[str, object], key: str) -> None:
    with pytest.raises(ResourcesError) as err:
        Resources.from_kwargs(**kwargs)
    message = assert_one_line(err, key)
    assert not message.startswith("resources.")


# --- gpus_per_node, describe, merge, to_dict ------------------------------------------


@pytest.mark.parametrize(
    ("resources", "gpus"),
    [
        (Resources(), 0),
        (Resources(accelerators=Accelerator("V100", 0.5)), 1),
        (Resources(accelerators=Accelerator("A100", 8)), 8),
    ],
)
def test_gpus_per_node(resources: Resources, gpus: int) -> None:
    assert resources.gpus_per_node == gpus


@pytest.mark.parametrize(
    ("resources", "num_nodes", "label", "text"),
    [
        (
            Resources(cpus=2, memory=8, accelerators=Accelerator("V100", 0.5)),
            3,
            "Kubernetes",
            "3x Kubernetes(2CPU--8GB--V100:0.5)",
        ),
        (Resources(accelerators=Accelerator("V100", 0.5)), 2, "Local", "2x Local(V100:0.5)"),
        (Resources(), 2, "Local", "2x Local"),
        (Resources(cpus=2.0), 1, "Local", "1x Local(2CPU)"),
        (Resources(memory=0.5), 1, "Local", "1x Local(0.5GB)"),
        (Resources(cpus=1.5, memory=16), 4, "Local", "4x Local(1.5CPU--16GB)"),
        (Resources(infra="k8s", image_id="img"), 1, "Kubernetes", "1x Kubernetes"),
        (Resources.from_dict({"cpus": "4+"}), 1, "Local", "1x Local(4CPU)"),
    ],
)
def test_describe(resources: Resources, num_nodes: int, label: str, text: str) -> None:
    assert resources.describe(num_nodes, label) == text


def test_merge_overrides_only_fields_that_are_set() -> None:
    base = Resources(cpus=2, memory=8, accelerators=Accelerator("V100", 1), infra="k8s/ctx")
    merged = base.merge(Resources(cpus=4, accelerators=Accelerator("A100", 0.5)))
    assert merged == Resources(cpus=4, memory=8, accelerators=Accelerator("A100", 0.5), infra="k8s/ctx")
    # the originals are untouched
    assert base.cpus == 2
    assert base.merge(Resources()) == base
    assert Resources().merge(base) == base


def test_merge_of_infra_replaces_its_context() -> None:
    merged = Resources(infra="k8s/ctx").merge(Resources(infra="local"))
    assert merged.infra == "local"
    assert merged.infra_context is None


@pytest.mark.parametrize(
    "resources",
    [
        Resources(),
        Resources(cpus=2, memory=0.5, accelerators=Accelerator("V100", 0.5)),
        Resources(infra="k8s/my-ctx", image_id="docker:ubuntu"),
        Resources(infra="local", accelerators=Accelerator("A100", 8)),
    ],
)
def test_to_dict_round_trips(resources: Resources) -> None:
    assert Resources.from_dict(resources.to_dict()) == resources


def test_skypilots_other_keys_are_checked_and_noted_as_inert() -> None:
    r = Resources.from_dict({"cpus": 2, "use_spot": True, "disk_size": 256, "ports": [8080], "labels": {"team": "ml"}})
    assert r.cpus == 2 and r.inert == ("disk_size", "labels", "ports", "use_spot")
    assert r == Resources(cpus=2)  # no effect on what is asked for
    with pytest.raises(ResourcesError) as err:
        Resources.from_dict({"disk_size": "big"})
    assert_one_line(err, "resources.disk_size has the wrong form", "'big'", "disk_size: 256")


def test_any_of_takes_the_first_alternative() -> None:
    r = Resources.from_dict({"cpus": 4, "any_of": [{"accelerators": "V100:1"}, {"accelerators": "A100:1"}]})
    assert (r.cpus, str(r.accelerators), r.inert) == (4, "V100:1", ("any_of",))
    with pytest.raises(ResourcesError) as err:
        Resources.from_dict({"ordered": [{"cpus": 0}]})
    assert_one_line(err, "resources.ordered[0].cpus")
    with pytest.raises(ResourcesError) as err:
        Resources.from_dict({"any_of": "V100"})
    assert_one_line(err, "resources.any_of must be a list of resources mappings")
