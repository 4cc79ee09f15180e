from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvmux.kv import InjectedFault, KvConfigError, failpoints


def test_counted_failpoint_fires_exactly_n_times() -> None:
    failpoints.arm("kv.copy_prefix", 2)
    for _ in range(2):
        with pytest.raises(InjectedFault, match=r"kv\.copy_prefix"):
            failpoints.hit("kv.copy_prefix")
    failpoints.hit("kv.copy_prefix")  # third hit passes
    assert failpoints.armed() == {}


def test_always_failpoint_until_disarmed() -> None:
    with failpoints.armed_for("kv.allocate"):
        for _ in range(5):
            with pytest.raises(InjectedFault):
                failpoints.hit("kv.allocate")
        failpoints.hit("kv.build_mask")  # others unaffected
    failpoints.hit("kv.allocate")


def test_parse_spec() -> None:
    assert failpoints.parse_spec("kv.copy_prefix") == {"kv.copy_prefix": failpoints.ALWAYS}
    assert failpoints.parse_spec(" kv.copy_prefix=2 , kv.allocate=1,") == {
        "kv.copy_prefix": 2,
        "kv.allocate": 1,
    }
    assert failpoints.parse_spec("") == {}


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("kv.nope", "unknown failpoint"),
        ("kv.allocate=0", "positive"),
        ("kv.allocate=x", "positive"),
    ],
)
def test_bad_spec_is_an_error(spec: str, needle: str) -> None:
    with pytest.raises(KvConfigError, match=needle):
        failpoints.parse_spec(spec)


def test_registered_names_can_be_armed() -> None:
    failpoints.register("test.custom_step")
    failpoints.arm("test.custom_step", 1)
    with pytest.raises(InjectedFault):
        failpoints.hit("test.custom_step")


def _run(env_value: str, code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, failpoints.ENV: env_value}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )


def test_a_running_process_arms_from_env() -> None:
    code = (
        "from kvmux.kv import HostKvCache, KvSpec, GrowthFailed\n"
        "from kvmux.kv import ensure_capacity, failpoints, resolve_hard_max\n"
        "failpoints.arm_from_env()\n"
        "c = HostKvCache(KvSpec(1, 1, 2), resolve_hard_max(None, None), min_bucket=2)\n"
        "outcomes = []\n"
        "for _ in range(3):\n"
        "    try:\n"
        "        ensure_capacity(c, 3); outcomes.append('ok')\n"
        "    except GrowthFailed as e:\n"
        "        outcomes.append(e.details['failed_step'])\n"
        "print(','.join(outcomes))\n"
    )
    proc = _run("kv.copy_prefix=2", code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "copy_prefix,copy_prefix,ok"


def test_invalid_env_fails_loudly_at_start() -> None:
    proc = _run("kv.copy_prefx", "from kvmux.kv import failpoints; failpoints.arm_from_env()")
    assert proc.returncode != 0
    assert "unknown failpoint 'kv.copy_prefx'" in proc.stderr


def test_a_slowed_failpoint_sleeps_without_failing() -> None:
    import time

    assert not failpoints.any_active()
    failpoints.slow("kv.copy_prefix", 0.05)
    assert failpoints.active("kv.copy_prefix") and not failpoints.active("kv.allocate")
    assert failpoints.any_active()
    t0 = time.perf_counter()
    failpoints.hit("kv.copy_prefix")  # sleeps, does not raise
    assert time.perf_counter() - t0 >= 0.045
    t0 = time.perf_counter()
    failpoints.hit("kv.allocate")  # other names are not slowed
    assert time.perf_counter() - t0 < 0.01
    failpoints.disarm("kv.copy_prefix")
    assert not failpoints.active("kv.copy_prefix") and not failpoints.any_active()
    t0 = time.perf_counter()
    failpoints.hit("kv.copy_prefix")
    assert time.perf_counter() - t0 < 0.01
    with pytest.raises(KvConfigError, match="unknown failpoint"):
        failpoints.slow("kv.nope", 1.0)
    with pytest.raises(KvConfigError, match="positive"):
        failpoints.slow("kv.allocate", 0.0)


def test_keyed_failpoint_fails_only_hits_naming_its_key() -> None:
    failpoints.arm("kv.allocate", 1, key="s2")
    failpoints.hit("kv.allocate")  # names no key
    failpoints.hit("kv.allocate", ["s1", "s3"])
    assert failpoints.armed() == {"kv.allocate": 1}  # a miss spends nothing
    with pytest.raises(InjectedFault, match=r"kv\.allocate@s2"):
        failpoints.hit("kv.allocate", ["s1", "s2"])
    failpoints.hit("kv.allocate", ["s2"])
    assert failpoints.parse_spec("kv.allocate@job/3=2") == {"kv.allocate@job/3": 2}
