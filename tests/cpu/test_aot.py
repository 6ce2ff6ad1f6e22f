"""The shipped precompiled kernel set (aot.py, scripts/build_aot.py, build_hub --aot-dir): the list is
dispatch's and the documented one; a small set built here (real sm_90a/sm_100a cross-compiles) loads
through the lookup order memory -> shipped -> disk -> compile, never from another fingerprint or
under another key; the switch ignores it; the Hub build refuses a stale set; warmup's profiles. When
`make build` has run (CI), every object of build/aot loads."""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flash_attn4 import aot, compile_cache, dispatch, native, settings, warmup
from flash_attn4.fa4_kernels.arch import IMPLEMENTED, Arch
from flash_attn4.fa4_kernels.config import (AppendConfig, BackwardConfig, CombineConfig, ForwardConfig,
                                           PostprocessConfig, SplitKVConfig)

REPO = Path(__file__).resolve().parents[2]
SHIPPED_ARCHS = (Arch.SM90, Arch.SM100)


def _script(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # build_aot's worker processes find build_one by module name
    spec.loader.exec_module(module)
    return module


build_aot, build_hub = _script("build_aot"), _script("build_hub")


def _newest_flavour_driver() -> int:
    """A driver version (cuDriverGetVersion's number) that the newest installed DSL runtime serves:
    stands in for the driver this machine lacks."""
    root = native.runtime_library(99000).parents[2]
    return max(int(p.name[2:]) for p in root.glob("cu[0-9]*") if p.name[2:].isdigit()) * 1000


# ---- the list ----


def _redispatch(cfg, shipped_bwd):
    """What dispatch builds for the problem class ``cfg`` describes (None for kinds checked elsewhere)."""
    if isinstance(cfg, ForwardConfig):
        # The head ratio it packs (pack_gqa_heads in padded groups of pack_gqa); 1 also for unpackable ones.
        group = cfg.pack_gqa if cfg.pack_gqa_heads else 0
        for ratio in {cfg.query_heads_per_group, 1}:
            again = dispatch.forward_config(cfg.arch, cfg.dtype, cfg.head_dim, cfg.head_dim_v, causal=cfg.causal,
                                            local=cfg.local, has_softcap=cfg.has_softcap, varlen=cfg.varlen,
                                            has_seqused_k=cfg.has_seqused_k, has_sink=cfg.has_sink,
                                            qhead_per_kvhead=ratio, page_size=cfg.page_size, split_kv=cfg.split_kv,
                                            has_seqused_q=cfg.has_seqused_q, pack_group=group if ratio > 1 else 0)
            if again == cfg:
                return again
        return None
    if isinstance(cfg, BackwardConfig):
        return dispatch.backward_config(cfg.arch, cfg.dtype, cfg.head_dim, cfg.head_dim_v, causal=cfg.causal,
                                        local=cfg.local, has_softcap=cfg.has_softcap, varlen=cfg.varlen,
                                        has_seqused_k=cfg.has_seqused_k, deterministic=cfg.deterministic)
    if isinstance(cfg, PostprocessConfig):
        return next((b.postprocess() for b in shipped_bwd if b.postprocess() == cfg), None)
    if isinstance(cfg, CombineConfig):
        return dispatch.combine_config(cfg.arch, cfg.dtype, cfg.head_dim_v, cfg.has_sink)
    if isinstance(cfg, SplitKVConfig):  # dispatch's pipeline around the split kernel it picks
        forward = _redispatch(cfg.forward, shipped_bwd)
        return None if forward is None else dispatch.split_kv_config(
            cfg.arch, cfg.forward.dtype, cfg.forward.head_dim, cfg.forward.head_dim_v, has_sink=cfg.combine.has_sink,
            causal=forward.causal, local=forward.local, has_softcap=forward.has_softcap, varlen=forward.varlen,
            has_seqused_k=forward.has_seqused_k, qhead_per_kvhead=forward.query_heads_per_group,
            page_size=forward.page_size, has_seqused_q=forward.has_seqused_q,
            pack_group=forward.pack_gqa if forward.pack_gqa_heads else 0)
    if isinstance(cfg, AppendConfig):
        return dispatch.append_config(cfg.arch, cfg.dtype, cfg.head_dim, cfg.head_dim_v, cfg.paged, cfg.has_rows)
    return dispatch.preprocess_config(cfg.arch, cfg.dtype, cfg.head_dim_v)


@pytest.mark.parametrize("arch", SHIPPED_ARCHS, ids=lambda a: a.value)
def test_every_shipped_config_is_one_dispatch_picks(arch):
    shipped = aot.shipped_configs(arch)
    assert shipped, f"nothing shipped for {arch.value}"
    bwd = [c for c in shipped if isinstance(c, BackwardConfig)]
    for cfg in shipped:
        assert _redispatch(cfg, bwd) == cfg, f"dispatch never picks the shipped {cfg}"
    keys = [(aot.kind_of(c),) + c.key() for c in shipped]
    assert len(keys) == len(set(keys)) and keys == sorted(keys)


@pytest.mark.parametrize("arch", SHIPPED_ARCHS, ids=lambda a: a.value)
def test_backward_ships_where_implemented_and_only_there(arch):
    kinds = {aot.kind_of(c) for c in aot.shipped_configs(arch)}
    assert ("bwd" in kinds) == ("backward" in IMPLEMENTED[arch])
    assert "fwd" in kinds


def _documented_profiles():
    """Rows `| name | head dim | heads / kv heads | ...` of docs/AOT.md's model table."""
    rows = re.findall(r"^\| `([^`]+)` \| (\d+)(?:/(\d+))? \| (\d+) / (\d+) \|", (REPO / "docs" / "AOT.md").read_text(),
                      re.M)
    return {name: (int(d), int(dv or d), int(h), int(hk)) for name, d, dv, h, hk in rows}


def test_docs_list_every_profile_with_its_shapes():
    documented = _documented_profiles()
    assert set(documented) == {p.name for p in aot.MODEL_PROFILES}
    for p in aot.MODEL_PROFILES:
        assert documented[p.name] == (p.head_dim, p.dv, p.num_heads, p.num_kv_heads), p.name


@pytest.mark.parametrize("arch", SHIPPED_ARCHS, ids=lambda a: a.value)
def test_no_documented_model_config_is_missing(arch):
    shipped = {(aot.kind_of(c),) + c.key() for c in aot.shipped_configs(arch)}
    for p in aot.MODEL_PROFILES:
        needed = aot.model_configs(arch, p, aot.SHIPPED_DTYPES)
        assert needed, p.name
        missing = [c for c in needed if (aot.kind_of(c),) + c.key() not in shipped]
        assert not missing, f"{p.name} on {arch.value}: {missing[:2]}"


def test_docs_state_the_shipped_counts():
    text = (REPO / "docs" / "AOT.md").read_text()
    for arch in SHIPPED_ARCHS:
        [count] = re.findall(rf"^\| {arch.value} \| (\d+) \|", text, re.M)
        assert int(count) == len(aot.shipped_configs(arch)), arch.value


@pytest.fixture
def requested_configs(monkeypatch):
    """CPU tensors pass validation and the device is a stand-in GPU of ``arch`` (set by the test);
    compiling records the configuration and yields a no-op kernel: what a call would need compiled,
    with nothing run (no self-check either). The shipped set and the disk cache are off, so every
    configuration reaches the recorder."""
    import torch

    from flash_attn4 import device_info, validate

    state = {"arch": Arch.SM90, "configs": []}

    def record(cfg, **_):
        state["configs"].append(cfg)
        return lambda *args: None

    sms = {Arch.SM90: ((9, 0), 132), Arch.SM100: ((10, 0), 148)}
    monkeypatch.setattr(validate, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(dispatch, "arch_for_device", lambda device, kernel="forward": state["arch"])
    monkeypatch.setattr(device_info, "get_device_info",
                        lambda device: device_info.DeviceInfo(0, "stand-in", *sms[state["arch"]]))
    for name in ("_compile_forward", "_compile_split_kv", "_compile_combine"):
        monkeypatch.setattr(compile_cache, name, record)
    for name in (settings.DISABLE_DISK_CACHE, settings.DISABLE_AOT):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv(settings.SELF_CHECK, "0")
    compile_cache.clear()
    torch.manual_seed(30)
    yield state
    compile_cache.clear()


@pytest.mark.parametrize("arch", SHIPPED_ARCHS, ids=lambda a: a.value)
@pytest.mark.parametrize("profile", [p for p in aot.MODEL_PROFILES if p.causal and p.full], ids=lambda p: p.name)
def test_the_adapters_decode_steps_run_shipped_kernels(requested_configs, arch, profile):
    """generate()'s one-query steps through the transformers adapter - dynamic cache, a static
    cache's unused tail, left padding; a short cache (one split) and, where the KV heads are few,
    a long one (split-KV) - need only kernels the shipped set holds: the first decode step of a
    listed model compiles nothing."""
    import torch

    from flash_attn4 import transformers_adapter

    requested_configs["arch"] = arch
    module = type("Attention", (), {"is_causal": True, "training": False})()
    hq, hk, d, dv = profile.num_heads, profile.num_kv_heads, profile.head_dim, profile.dv
    lengths = (64, 16384) if hk <= 8 else (64,)
    for keys in lengths:
        q = torch.randn(2, hq, 1, d, dtype=torch.bfloat16)
        k, v = (torch.randn(2, hk, keys, dim, dtype=torch.bfloat16) for dim in (d, dv))
        tail, left = torch.ones(2, keys, dtype=torch.bool), torch.ones(2, keys, dtype=torch.bool)
        tail[:, -5:] = False  # a static cache: keys past the tokens seen
        left[1, :7] = False  # left padding
        for mask in (None, tail, left):
            out, _ = transformers_adapter.attention_forward(module, q, k, v, mask)
            assert out.shape == (2, 1, hq, dv)
    requested = {(aot.kind_of(c),) + c.key(): c for c in requested_configs["configs"]}
    assert {aot.kind_of(c) for c in requested.values()} == ({"fwd", "split_kv"} if len(lengths) > 1 else {"fwd"})
    shipped = {(aot.kind_of(c),) + c.key() for c in aot.shipped_configs(arch)}
    missing = [c for key, c in requested.items() if key not in shipped]
    assert not missing, f"{profile.name} on {arch.value} compiles at its first decode step: {missing}"


def test_model_configs_follow_the_profile():
    gemma = aot.ModelProfile("g", 256, 16, 8, sliding=True, softcap=True)
    fwd = [c for c in aot.model_configs(Arch.SM90, gemma, ("float16",)) if isinstance(c, ForwardConfig)]
    assert {(c.causal, c.local) for c in fwd} == {(True, False), (False, True)}
    assert all(c.has_softcap and c.dtype == "float16" and c.head_dim == 256 for c in fwd)
    assert {c.pack_gqa for c in fwd} == {2}
    bert = aot.ModelProfile("b", 64, 12, 12, causal=False)
    assert all(not c.causal and not c.local for c in aot.model_configs(Arch.SM90, bert) if hasattr(c, "causal"))
    assert not any(isinstance(c, BackwardConfig) for c in aot.model_configs(Arch.SM90, bert, training=False))
    with pytest.raises(ValueError, match="num_kv_heads"):
        aot.ModelProfile("bad", 128, 10, 4).ratio


@pytest.mark.parametrize("arch", SHIPPED_ARCHS, ids=lambda a: a.value)
def test_ci_shards_partition_the_shipped_set(arch):
    """.ci/run compiles one eighth of the shipped set per commit (build_aot --shard K/8, K from the
    commit hash): the eight shards are disjoint and together the whole set, each about an eighth;
    a malformed shard is refused."""
    ci = (REPO / ".ci" / "run").read_text()
    count = int(re.search(r"% (\d+) \)\)/(\d+)", ci).group(1))
    assert count == 8 and "AOT_SHARD=" in ci
    configs = aot.shipped_configs(arch)
    shards = [build_aot.sharded(configs, (k, count)) for k in range(count)]
    assert sorted(map(repr, (c for shard in shards for c in shard))) == sorted(map(repr, configs))
    assert all(abs(len(shard) - len(configs) / count) < 1 for shard in shards)
    assert build_aot.sharded(configs, None) == configs
    assert build_aot.parse_shard("3/4") == (3, 4)
    for bad in ("4/4", "-1/4", "1", "a/b", "1/0"):
        with pytest.raises(ValueError, match="K/N"):
            build_aot.parse_shard(bad)


# ---- a small set built here: lookup, fingerprint, key, switch ----


@pytest.fixture(scope="module")
def small_set(tmp_path_factory):
    """The first configuration of each arch's shipped set, really compiled and exported."""
    out = tmp_path_factory.mktemp("aot")
    assert build_aot.build(out, list(SHIPPED_ARCHS), jobs=2, only=1) == 0
    return out, json.loads((out / aot.MANIFEST).read_text())


def _config_of(entry):
    for arch in SHIPPED_ARCHS:
        for cfg in aot.shipped_configs(arch):
            if aot.kind_of(cfg) == entry["kind"] and list(cfg.key()) == entry["key"]:
                return cfg
    raise AssertionError(f"manifest entry not in the shipped list: {entry}")


@pytest.fixture
def shipped_env(small_set, monkeypatch, tmp_path):
    out, manifest = small_set
    driver = _newest_flavour_driver()
    monkeypatch.setattr(native, "_driver_cuda_version", lambda: driver)  # no GPU here
    monkeypatch.setenv(settings.AOT_DIR, str(out))
    monkeypatch.delenv(settings.DISABLE_AOT, raising=False)
    monkeypatch.setenv(settings.CACHE_DIR, str(tmp_path / "disk"))
    compile_cache.clear()
    yield out, manifest
    compile_cache.clear()


def _refuse_compile(cfg, jit_engine=True):
    raise AssertionError(f"compiled {cfg} although it is shipped")


def test_manifest_describes_the_built_objects(small_set):
    out, manifest = small_set
    assert manifest["fingerprint"] == compile_cache.source_fingerprint()
    assert {e["arch"] for e in manifest["entries"]} == {a.value for a in SHIPPED_ARCHS}
    for entry in manifest["entries"]:
        path = out / manifest["fingerprint"] / entry["file"]
        assert path.stat().st_size == entry["bytes"] > 10_000
        sidecar = json.loads(path.with_suffix(".json").read_text())
        assert sidecar == {"kind": entry["kind"], "key": entry["key"], "fingerprint": manifest["fingerprint"]}
        assert entry["models"], entry  # which profiles need it


def test_shipped_kernel_is_loaded_not_compiled(shipped_env):
    _, manifest = shipped_env
    for entry in manifest["entries"]:
        cfg = _config_of(entry)
        fn = compile_cache.get_kernel(entry["kind"], cfg, _refuse_compile)
        assert type(fn).__name__ == "Function" and callable(fn)
        assert compile_cache.get_kernel(entry["kind"], cfg, _refuse_compile) is fn  # memory first
    stats = compile_cache.stats()
    n = len(manifest["entries"])
    assert (stats["aot_hits"], stats["compiled"], stats["memory_hits"], stats["disk_writes"]) == (n, 0, n, 0)


def _counting(calls):
    def compile_fn(cfg, jit_engine=True):
        calls.append(cfg)
        raise RuntimeError("compile reached")  # stops before any disk write; the test only needs the order
    return compile_fn


LOAD_WITHOUT_DSL = r"""
import json, sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
from flash_attn4 import aot, compile_cache, native
from flash_attn4.fa4_kernels.arch import Arch
native._driver_cuda_version = lambda: int(sys.argv[3])
def refuse(*args, **kwargs):
    raise AssertionError("compiled")
entry = json.loads(sys.argv[4])
[cfg] = [c for c in aot.shipped_configs(Arch.parse(entry["arch"]))
         if aot.kind_of(c) == entry["kind"] and list(c.key()) == entry["key"]]
fn = compile_cache.get_kernel(entry["kind"], cfg, refuse)
print(json.dumps({"callable": callable(fn), "cutlass": "cutlass" in sys.modules, "stats": compile_cache.stats()}))
"""


def test_shipped_kernel_loads_without_importing_the_dsl(shipped_env):
    """A fresh process gets a shipped kernel without ``import cutlass`` (native.py: the 0.75 s import
    is most of a cold start's time otherwise)."""
    out, manifest = shipped_env
    entry = manifest["entries"][0]
    done = subprocess.run([sys.executable, "-c", LOAD_WITHOUT_DSL, str(REPO / "torch-ext"), str(REPO),
                           str(_newest_flavour_driver()), json.dumps(entry)],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["callable"] and not result["cutlass"], result
    assert (result["stats"]["aot_hits"], result["stats"]["compiled"]) == (1, 0), result


def test_switch_ignores_the_shipped_set(shipped_env, monkeypatch):
    _, manifest = shipped_env
    monkeypatch.setenv(settings.DISABLE_AOT, "1")
    entry = manifest["entries"][0]
    calls = []
    with pytest.raises(RuntimeError, match="compile reached"):
        compile_cache.get_kernel(entry["kind"], _config_of(entry), _counting(calls))
    assert len(calls) == 1 and compile_cache.stats()["aot_hits"] == 0


def test_other_fingerprint_is_never_loaded(shipped_env, monkeypatch):
    _, manifest = shipped_env
    monkeypatch.setattr(compile_cache, "_fingerprint", "0" * 24)  # as if a kernel source had changed
    entry = manifest["entries"][0]
    calls = []
    with pytest.raises(RuntimeError, match="compile reached"):
        compile_cache.get_kernel(entry["kind"], _config_of(entry), _counting(calls))
    assert len(calls) == 1 and compile_cache.stats()["aot_hits"] == 0


def test_object_under_another_key_is_not_used(small_set, tmp_path, monkeypatch):
    """A file whose sidecar names another key (renamed, mixed up) is passed over."""
    out, manifest = small_set
    entry = manifest["entries"][0]
    cfg = _config_of(entry)
    other = cfg.replace(dtype="float16")
    folder = tmp_path / "aot" / manifest["fingerprint"]
    folder.mkdir(parents=True)
    name = compile_cache.entry_path(entry["kind"], other.key()).with_suffix(native.SUFFIX).name
    shutil.copyfile(out / manifest["fingerprint"] / entry["file"], folder / name)
    shutil.copyfile((out / manifest["fingerprint"] / entry["file"]).with_suffix(".json"),
                    (folder / name).with_suffix(".json"))
    monkeypatch.setenv(settings.AOT_DIR, str(tmp_path / "aot"))
    monkeypatch.delenv(settings.DISABLE_AOT, raising=False)
    assert aot.shipped_entry(entry["kind"], other.key(), name, manifest["fingerprint"]) is None
    monkeypatch.setenv(settings.AOT_DIR, str(out))
    assert aot.shipped_entry(entry["kind"], cfg.key(), entry["file"], manifest["fingerprint"]) is not None


def test_default_root_is_inside_the_package(monkeypatch):
    monkeypatch.delenv(settings.AOT_DIR, raising=False)
    monkeypatch.delenv(settings.DISABLE_AOT, raising=False)
    assert aot.shipped_root() == Path(aot.__file__).resolve().parent / "aot"
    monkeypatch.setenv(settings.DISABLE_AOT, "yes")
    assert aot.shipped_root() is None
    monkeypatch.setenv(settings.DISABLE_AOT, "maybe")
    with pytest.raises(ValueError, match=settings.DISABLE_AOT):
        aot.shipped_root()
    assert settings.DISABLE_AOT in settings.ALL and settings.DISABLE_AOT in settings.__doc__


# ---- the Hub tree ----


def test_hub_build_ships_the_set(small_set, tmp_path):
    out, manifest = small_set
    [variant] = build_hub.build(REPO, tmp_path / "build", "0000000", aot_dir=out)
    shipped = variant / "aot"
    assert json.loads((shipped / aot.MANIFEST).read_text()) == manifest
    files = sorted(p.name for p in (shipped / manifest["fingerprint"]).iterdir())
    assert files == sorted(n for e in manifest["entries"] for n in (e["file"], Path(e["file"]).with_suffix(".json").name))
    meta = json.loads((variant / "metadata.json").read_text())
    assert f"aot/{manifest['fingerprint']}/{manifest['entries'][0]['file']}" in meta["digest"]["files"]
    # The tree's own kernel sources give the fingerprint the set was built under (what it computes at run time).
    assert compile_cache.source_fingerprint(variant / "fa4_kernels") == manifest["fingerprint"]


def test_hub_build_refuses_a_stale_set(small_set, tmp_path):
    out, manifest = small_set
    stale = tmp_path / "stale"
    shutil.copytree(out, stale)
    (stale / aot.MANIFEST).write_text(json.dumps(dict(manifest, fingerprint="f" * 24)))
    with pytest.raises(build_hub.BuildError, match="other kernel sources"):
        build_hub.build(REPO, tmp_path / "build", "0000000", aot_dir=stale)
    with pytest.raises(build_hub.BuildError, match="no manifest.json"):
        build_hub.build(REPO, tmp_path / "build2", "0000000", aot_dir=tmp_path / "nothing")


# ---- the full set, when `make build` made it (CI runs it before the tests) ----

BUILT = REPO / "build" / "aot"


@pytest.mark.skipif(not (BUILT / aot.MANIFEST).is_file(), reason="no build/aot (run `make aot` or `make build`)")
def test_every_built_object_loads():
    manifest = json.loads((BUILT / aot.MANIFEST).read_text())
    if manifest["fingerprint"] != compile_cache.source_fingerprint():
        pytest.skip("build/aot is from other sources: rebuild with `make aot`")
    # CI builds one shard of the set (build_aot --shard, in the manifest); a release all of it.
    shard = build_aot.parse_shard(manifest["shard"]) if "shard" in manifest else None
    expected = {(a.value, aot.kind_of(c)) + c.key() for a in map(Arch.parse, manifest["archs"])
                for c in build_aot.sharded(aot.shipped_configs(a, dtypes=tuple(manifest["dtypes"])), shard)}
    assert {(e["arch"], e["kind"]) + tuple(e["key"]) for e in manifest["entries"]} == expected
    for entry in manifest["entries"]:
        fn = native.load(BUILT / manifest["fingerprint"] / entry["file"], compile_cache.EXPORT_NAME,
                         driver_version=_newest_flavour_driver())
        assert callable(fn), entry["file"]


# ---- warmup ----


def test_warmup_profile_from_transformers_configs():
    transformers = pytest.importorskip("transformers")
    gemma = warmup.profile_from_config(transformers.Gemma2Config(
        head_dim=256, num_attention_heads=16, num_key_value_heads=8, sliding_window=4096,
        attn_logit_softcapping=50.0))
    assert (gemma.head_dim, gemma.ratio, gemma.sliding, gemma.full, gemma.softcap) == (256, 2, True, True, True)
    llama = warmup.profile_from_config(transformers.LlamaConfig(hidden_size=2048, num_attention_heads=32,
                                                                num_key_value_heads=8))
    assert (llama.head_dim, llama.ratio, llama.sliding, llama.softcap, llama.causal) == (64, 4, False, False, True)
    assert not warmup.profile_from_config(transformers.BertConfig()).causal


def test_warmup_compiles_into_the_disk_cache_once(monkeypatch, tmp_path):
    """A one-kernel profile (inference, no decode patterns: bert-like) compiled for real, then found on disk."""
    monkeypatch.setenv(settings.CACHE_DIR, str(tmp_path / "disk"))
    monkeypatch.setenv(settings.DISABLE_AOT, "1")
    monkeypatch.delenv(settings.DISABLE_DISK_CACHE, raising=False)
    monkeypatch.setattr(aot, "CALL_PATTERNS", ("dense",))
    profile = aot.ModelProfile("tiny", 64, 4, 4, causal=False)
    monkeypatch.setattr(aot, "forward_configs", lambda arch, p, dtype, patterns=("dense",):
                        [dispatch.forward_config(arch, dtype, 64, 64, causal=False, local=False, has_softcap=False,
                                                 varlen=False, has_seqused_k=False, has_sink=False)])
    compile_cache.clear()
    first = warmup.warmup(profile, Arch.SM90, training=False, progress=None)
    assert first["compiled"] == 1 and first["disk_writes"] == 1
    compile_cache.clear()
    again = warmup.warmup(profile, Arch.SM90, training=False, progress=None)
    assert again["compiled"] == 0 and again["disk_hits"] == 1
    compile_cache.clear()


def test_warmup_cli_needs_shapes_or_a_model(capsys):
    assert warmup.main(["--arch", "sm_90a"]) == 2
    assert "--head-dim" in capsys.readouterr().err
    assert warmup.main(["--arch", "sm_42", "--head-dim", "64", "--heads", "4"]) == 2
