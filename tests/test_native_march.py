"""``LORAPLEX_NATIVE_MARCH``: the native kernels built for an older CPU than this one (engine.cpu).

The flags the engine chooses its paths by narrow to what that build has, and the AVX2 build's
engine (what Zen 3 and pre-AVX-512 Intel CPUs run: the float32 panel kernel, AVX2's 8- and 4-bit
kernels, the blocked LoRA rows, the one-call decoder over each) passes the kernel and engine
tests that depend on the instruction set, on a machine whose own build takes the AVX-512 paths.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from engine import cpu, native

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def set_march(monkeypatch):
    def set_(value: str | None) -> None:
        if value is None:
            monkeypatch.delenv(cpu.MARCH_ENV, raising=False)
        else:
            monkeypatch.setenv(cpu.MARCH_ENV, value)
        cpu.cpu_flags.cache_clear()

    yield set_
    monkeypatch.delenv(cpu.MARCH_ENV, raising=False)
    cpu.cpu_flags.cache_clear()


def test_isa_flags_map_to_the_compilers_macros():
    assert cpu._isa_macro("avx512_vnni") == "__AVX512VNNI__"
    assert cpu._isa_macro("avx512f") == "__AVX512F__"
    assert cpu._isa_macro("avx512_bf16") == "__AVX512BF16__"
    assert cpu._isa_macro("amx_bf16") == "__AMX_BF16__"
    assert cpu._isa_macro("avx2") == "__AVX2__" and cpu._isa_macro("fma") == "__FMA__"
    assert cpu._isa_macro("sse4_2") is None and cpu._isa_macro("bmi2") is None
    macros = cpu.march_macros("sapphirerapids")
    assert {"__AVX512VNNI__", "__AVX512BF16__", "__AMX_BF16__", "__AMX_TILE__", "__AVX2__", "__FMA__"} <= macros


def test_an_older_march_narrows_the_flags_and_the_build(set_march):
    own = cpu._proc_flags()
    set_march(None)
    assert cpu.march() == "native" and cpu.cpu_flags() == own
    assert "-march=native" in native.cflags()
    set_march("x86-64-v3")
    narrowed = cpu.cpu_flags()
    assert not any(f.startswith(("avx512", "amx")) for f in narrowed)
    assert ("avx2" in narrowed) == ("avx2" in own) and ("fma" in narrowed) == ("fma" in own)
    assert {f for f in own if cpu._isa_macro(f) is None} <= narrowed, "other flags are left alone"
    assert not cpu.cpu_has_vnni() and not cpu.cpu_has_bf16_matmul()
    assert "-march=x86-64-v3" in native.cflags() and "-march=native" not in native.cflags()
    set_march("x86-64")
    assert not cpu.cpu_flags() & {"avx", "avx2", "fma"} and not cpu.cpu_has_avx2()


def test_a_march_the_compiler_refuses_is_an_error_naming_the_setting(set_march):
    set_march("no-such-cpu")
    with pytest.raises(ValueError, match="LORAPLEX_NATIVE_MARCH=no-such-cpu"):
        cpu.cpu_flags()


# The tests whose paths depend on the instruction set, without the slow demo-model gates of the
# bfloat16 and 8-bit formats (the 4-bit one, the format such CPUs serve fastest, is kept), and the
# cross-tenant isolation suite in float32 (there on the panel kernel, in the one-call decoder).
AVX2_SUITE = ["tests/test_engine_native.py", "tests/test_lora_ops.py", "tests/test_engine_int8.py",
              "tests/test_engine_int4.py", "tests/test_engine_weights.py", "tests/test_lora_isolation.py",
              "-k", "not test_demo_bf16 and not test_demo_int8"]
# ... of which these must pass, not skip (the panel ones run only on builds without AVX-512).
AVX2_ONLY = ["test_panel_matmul_matches_linear", "test_float32_panels_take_the_one_call_decoder",
             "test_native_decoder_layers_match_the_kernels_called_one_by_one[base-auto]",
             "test_native_decoder_layers_match_the_kernels_called_one_by_one[adapters-auto]",
             "test_demo_int4_weights_track_float32", "test_mixed_batch_every_row_matches_its_adapter_alone"]


@pytest.mark.slow
@pytest.mark.skipif(not {"avx2", "fma"} <= cpu._proc_flags(), reason="this CPU cannot run the AVX2 build")
@pytest.mark.skipif("avx512f" not in cpu._proc_flags(),
                    reason="this CPU's own build is the AVX2 one: the rest of the suite runs it")
def test_the_avx2_build_passes_the_instruction_set_tests(tmp_path):
    report = tmp_path / "avx2.xml"
    env = {**os.environ, cpu.MARCH_ENV: "x86-64-v3"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                           *AVX2_SUITE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    cases = ET.parse(report).getroot().iter("testcase")
    outcome = {c.get("name", ""): ("skipped" if c.find("skipped") is not None else "passed") for c in cases}
    assert sum(v == "passed" for v in outcome.values()) > 200, outcome
    for name in AVX2_ONLY:
        ran = [k for k in outcome if k.startswith(name)]
        assert ran and all(outcome[k] == "passed" for k in ran), (name, {k: outcome[k] for k in ran})


def test_the_start_up_log_names_the_kernels_that_run(tmp_path):
    """``loraplex worker`` logs ``model.kernels`` with the loaded model: the build and the one call."""
    from engine.engine import Engine, EngineConfig
    from tests.lora_fixtures import save_tiny_llama, tiny_engine

    base_dir = save_tiny_llama(tmp_path / "base")
    blocks = tiny_engine(base_dir, weights="int8").model
    assert blocks.decoder is not None
    assert blocks.kernels == f"native kernels for -march={cpu.march()}, a step's layers in one call"
    blocks.decoder = None
    assert blocks.kernels.endswith(", layer by layer")
    torch_only = Engine.from_path(base_dir, EngineConfig(native_kernels=False, max_model_len=96)).model
    assert torch_only.kernels == "torch kernels"
