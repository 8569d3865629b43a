"""torch.distributed on tpu through the tpu_dist backend (host-staged).

Every check runs in real processes on localhost (torch.multiprocessing's
"spawn" context; a FileStore in the test's tmp_path, so no port races), each
job bounded by a timeout and killed on expiry. One 2-rank job runs every
collective x dtype and compares each result with the same collective run by
gloo on CPU tensors of the same values (exact: the host-staged transport
computes on the same host values; AVG and PREMUL_SUM, which gloo lacks, are
compared with gloo's SUM divided / pre-multiplied on CPU).

Tiers: the default run (about 2 minutes on 2 cores) checks the collectives
in strict mode, the zero-copy path's cases, a 1-D DeviceMesh, failures, DDP (strict and fused), FSDP2
(fp32 and bf16/f32 mixed precision) and functional collectives in a
torch.compile graph;
TORCH_TPU_DIST_FULL=1 adds the collectives in fused mode, a 4-rank 2-D
DeviceMesh with sub-groups and two torchrun "nodes" on localhost.
"""
from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import subprocess
import sys
import time
import traceback
import zlib

import pytest
import torch

WORLD = 2
JOB_TIMEOUT_S = 150
FULL = os.environ.get("TORCH_TPU_DIST_FULL", "") not in ("", "0")
full_tier = pytest.mark.skipif(not FULL, reason="full distributed tier: TORCH_TPU_DIST_FULL=1")


# --------------------------------------------------------------------------
# launcher


def _child(fn, rank, world, store_path, out_dir, env, args):
    os.environ.update(env)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    result = {"rank": rank}
    try:
        import torch.distributed as dist

        import torch_tpu  # noqa: F401

        dist.init_process_group(
            backend=args.get("backend", "tpu_dist"), init_method=f"file://{store_path}", rank=rank,
            world_size=world, timeout=datetime.timedelta(seconds=args.get("pg_timeout_s", 60)))
        result.update(fn(rank, world, args))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        result["error"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def _start_and_join(procs, timeout: float) -> None:
    """Starts the rank processes and waits for all of them within `timeout`
    seconds; a rank still running then is a hang (the test fails), and every
    process still alive is killed."""
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        assert not hung, f"ranks {hung} still running after {timeout} s (a hang)"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)


def run_job(tmp_path, fn, args=None, world=WORLD, env=None, timeout=JOB_TIMEOUT_S, expect_exit=None):
    """Runs fn(rank, world, args) -> dict in `world` spawned processes after
    init_process_group; returns the per-rank dicts. Kills every process still
    alive after `timeout` seconds and fails naming them."""
    ctx = multiprocessing.get_context("spawn")
    out_dir = tmp_path / "out"
    out_dir.mkdir(exist_ok=True)
    store = tmp_path / "store"
    env = {"TORCH_TPU_CPU_DEVICES": str(world), **(env or {})}
    procs = [ctx.Process(target=_child, args=(fn, r, world, str(store), str(out_dir), env, args or {}))
             for r in range(world)]
    _start_and_join(procs, timeout)
    results = []
    for r in range(world):
        path = out_dir / f"rank{r}.json"
        if expect_exit is not None and r in expect_exit:
            results.append(None)
            continue
        assert path.exists(), f"rank {r} exited with {procs[r].exitcode} and no result"
        res = json.loads(path.read_text())
        assert "error" not in res, f"rank {r} failed:\n{res['error']}"
        results.append(res)
    return results


# --------------------------------------------------------------------------
# every collective x dtype against gloo on CPU

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "int64": torch.int64, "bool": torch.bool}
FLOAT_ONLY_OPS = ("AVG", "PREMUL_SUM")


def _values(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype == torch.int64:
        return torch.randint(-50, 50, shape, generator=g)
    return (torch.randn(shape, generator=g) * 4).to(dtype)


def _collective_cases():
    cases = []
    for dname in DTYPES:
        for op in ("SUM", "PRODUCT", "MIN", "MAX", "AVG", "PREMUL_SUM"):
            if op in FLOAT_ONLY_OPS and dname in ("int64", "bool"):
                continue
            cases.append(f"all_reduce-{op}-{dname}")
        for name in ("broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                     "reduce_scatter_tensor", "all_to_all", "all_to_all_single_uneven", "gather", "scatter",
                     "send_recv", "all_reduce_coalesced", "all_reduce_async"):
            if dname == "bool" and name in ("reduce_scatter", "reduce_scatter_tensor", "all_reduce_coalesced"):
                continue  # gloo's reduce_scatter has no bool kernel; checked against gloo below in its own case
            cases.append(f"{name}-{dname}")
        # cpu tensors given to tpu_dist (init_process_group("tpu_dist") maps cpu to it)
        for name in ("cpu_all_reduce", "cpu_all_reduce_avg", "cpu_all_to_all"):
            if name == "cpu_all_reduce_avg" and dname in ("int64", "bool"):
                continue
            cases.append(f"{name}-{dname}")
    return cases


def _run_case(case, rank, world, tpu_group, cpu_group):
    """Returns (tpu result, gloo-on-cpu result) as lists of CPU tensors."""
    import torch.distributed as dist

    parts = case.split("-")
    name, dtype = parts[0], DTYPES[parts[-1]]
    dev = torch.device("tpu", torch.tpu.current_device())
    seed = 1000 * rank + zlib.crc32(case.encode()) % 997

    def both(f):
        # f(device, group) -> list of tensors; run on tpu (tpu_dist) and cpu (gloo)
        return [t.cpu() for t in f(dev, tpu_group)], f(torch.device("cpu"), cpu_group)

    x = _values((3, 5), dtype, seed)
    if name.startswith("cpu_"):
        # the same cpu values through tpu_dist's group and through gloo's
        def f(d, g):
            t = x.clone()
            if name == "cpu_all_reduce":
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g)
                return [t]
            if name == "cpu_all_reduce_avg":
                if g is cpu_group:
                    dist.all_reduce(t, group=g)
                    return [t.div_(world)]
                dist.all_reduce(t, op=dist.ReduceOp.AVG, group=g)
                return [t]
            outs = [torch.zeros((1 + rank, 5), dtype=dtype) for _ in range(world)]
            ins = [x[:1 + j] for j in range(world)]
            if g is cpu_group:
                out = torch.cat(outs)
                dist.all_to_all_single(out, torch.cat(ins), [1 + rank] * world, [1 + j for j in range(world)], group=g)
                return list(out.split(1 + rank))
            dist.all_to_all(outs, ins, group=g)
            return outs
        return f(None, tpu_group), f(None, cpu_group)
    if name == "all_reduce":
        op = parts[1]
        if op == "PREMUL_SUM":
            def f(d, g):
                t = x.to(d)
                if d.type == "cpu":
                    t = t * 2.5  # the reference: gloo's SUM of pre-multiplied values
                    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=g)
                else:
                    dist.all_reduce(t, op=dist._make_nccl_premul_sum(2.5), group=g)
                return [t]
        elif op == "AVG":
            def f(d, g):
                t = x.to(d)
                if d.type == "cpu":
                    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=g)
                    t.div_(world)
                else:
                    dist.all_reduce(t, op=dist.ReduceOp.AVG, group=g)
                return [t]
        else:
            def f(d, g):
                t = x.to(d)
                dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=g)
                return [t]
        return both(f)
    if name == "all_reduce_async":
        def f(d, g):
            t = x.to(d)
            # pending tpu work on the input must be complete before it is read
            t = t + t if dtype != torch.bool else t | t
            w = dist.all_reduce(t, async_op=True, group=g)
            w.wait()
            assert w.is_completed()
            fut = dist.all_reduce(t, async_op=True, group=g).get_future()
            (v,) = fut.wait()
            assert v.device == t.device and v.data_ptr() == t.data_ptr()
            return [t]
        return both(f)
    if name == "all_reduce_coalesced":
        y = _values((7,), dtype, seed + 1)

        def f(d, g):
            ts = [x.to(d), y.to(d)]
            with dist._coalescing_manager(group=g, async_ops=True) as cm:
                for t in ts:
                    dist.all_reduce(t, group=g)
            cm.wait()
            return ts
        return both(f)
    if name == "broadcast":
        def f(d, g):
            t = x.to(d)
            dist.broadcast(t, src=1, group=g)
            return [t]
        return both(f)
    if name == "reduce":
        def f(d, g):
            t = x.to(d)
            dist.reduce(t, dst=0, group=g)
            return [t] if rank == 0 else []
        return both(f)
    if name == "all_gather":
        def f(d, g):
            outs = [torch.zeros_like(x, device=d) for _ in range(world)]
            dist.all_gather(outs, x.to(d), group=g)
            return outs
        return both(f)
    if name == "all_gather_into_tensor":
        def f(d, g):
            out = torch.zeros((world * 3, 5), dtype=dtype, device=d)
            dist.all_gather_into_tensor(out, x.to(d), group=g)
            return [out]
        return both(f)
    if name == "reduce_scatter":
        ins = [_values((4,), dtype, seed + i) for i in range(world)]

        def f(d, g):
            out = torch.zeros((4,), dtype=dtype, device=d)
            dist.reduce_scatter(out, [t.to(d) for t in ins], group=g)
            return [out]
        return both(f)
    if name == "reduce_scatter_tensor":
        big = _values((world * 4, 3), dtype, seed)

        def f(d, g):
            out = torch.zeros((4, 3), dtype=dtype, device=d)
            dist.reduce_scatter_tensor(out, big.to(d), group=g)
            return [out]
        return both(f)
    if name == "all_to_all":
        ins = [_values((2 + i, 3), dtype, seed + i) for i in range(world)]

        def f(d, g):
            # rank r sends (2 + j) rows to rank j and receives (2 + r) rows from each
            # (gloo's list form needs equal sizes: its reference is all_to_all_single of the rows)
            outs = [torch.zeros((2 + rank, 3), dtype=dtype, device=d) for _ in range(world)]
            if d.type == "cpu":
                out = torch.cat(outs)
                dist.all_to_all_single(out, torch.cat(ins), [2 + rank] * world, [2 + j for j in range(world)],
                                       group=g)
                return list(out.split(2 + rank))
            dist.all_to_all(outs, [t.to(d) for t in ins], group=g)
            return outs
        return both(f)
    if name == "all_to_all_single_uneven":
        in_splits = [1 + rank + j for j in range(world)]  # rows rank sends to j
        out_splits = [1 + j + rank for j in range(world)]  # rows j sends to rank
        inp = _values((sum(in_splits), 2), dtype, seed)

        def f(d, g):
            out = torch.zeros((sum(out_splits), 2), dtype=dtype, device=d)
            dist.all_to_all_single(out, inp.to(d), out_splits, in_splits, group=g)
            return [out]
        return both(f)
    if name == "gather":
        def f(d, g):
            outs = [torch.zeros_like(x, device=d) for _ in range(world)] if rank == 1 else None
            dist.gather(x.to(d), outs, dst=1, group=g)
            return outs or []
        return both(f)
    if name == "scatter":
        chunks = [_values((3,), dtype, 77 + i) for i in range(world)]  # the same on every rank

        def f(d, g):
            out = torch.zeros((3,), dtype=dtype, device=d)
            dist.scatter(out, [c.to(d) for c in chunks] if rank == 0 else None, src=0, group=g)
            return [out]
        return both(f)
    if name == "send_recv":
        def f(d, g):
            t = x.to(d)
            if rank == 0:
                dist.send(t, dst=1, group=g)
                return []
            r = torch.zeros_like(t)
            dist.recv(r, src=0, group=g)
            return [r]
        return both(f)
    raise AssertionError(case)


def _collectives_worker(rank, world, args):
    import torch.distributed as dist

    import torch_tpu

    torch.tpu.set_device(rank)
    torch_tpu.set_eager_mode(args["mode"])
    cpu_group = dist.new_group(backend="gloo")
    tpu_group = dist.group.WORLD
    report = {}
    for case in _collective_cases():
        try:
            got, want = _run_case(case, rank, world, tpu_group, cpu_group)
            assert len(got) == len(want), (len(got), len(want))
            for g, w in zip(got, want):
                assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, w.dtype, g.shape, w.shape)
                assert torch.equal(g, w), f"tpu {g.flatten()[:6].tolist()} vs gloo {w.flatten()[:6].tolist()}"
            report[case] = "ok"
        except Exception as e:  # noqa: BLE001 - one entry per case
            report[case] = f"{type(e).__name__}: {e}"
    # bad input: AVG of integers names the collective and the dtype
    try:
        dist.all_reduce(torch.ones(3, dtype=torch.int64, device="tpu"), op=dist.ReduceOp.AVG)
        report["_avg_int_error"] = "no error"
    except RuntimeError as e:
        report["_avg_int_error"] = str(e).splitlines()[0]
    # the backend behind each device of the default group
    pg = dist.group.WORLD
    report["_backends"] = {d: type(pg._get_backend(torch.device(d))).__name__ for d in ("tpu", "cpu")}
    dist.barrier()
    return {"report": report}


@pytest.fixture(scope="module", params=["strict", pytest.param("fused", marks=full_tier)])
def collective_reports(request, tmp_path_factory):
    results = run_job(tmp_path_factory.mktemp(f"coll-{request.param}"), _collectives_worker,
                      {"mode": request.param})
    return [r["report"] for r in results]


@pytest.mark.parametrize("case", _collective_cases())
def test_collective_matches_gloo(collective_reports, case):
    for rank, report in enumerate(collective_reports):
        assert report[case] == "ok", f"rank {rank}: {case}: {report[case]}"


def test_avg_of_integers_raises(collective_reports):
    msg = collective_reports[0]["_avg_int_error"]
    assert "tpu_dist allreduce: ReduceOp.AVG needs floating point tensors, got Long" in msg, msg


def test_backend_map(collective_reports):
    assert collective_reports[0]["_backends"] == {"tpu": "ProcessGroupTPU", "cpu": "ProcessGroupTPU"}


# --------------------------------------------------------------------------
# init variants, DeviceMesh, sub-groups


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mesh_worker(rank, world, args):
    """init_device_mesh("tpu", shape) initializes the default group itself
    (init_process_group() with no backend) and binds LOCAL_RANK's device."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    shape = tuple(args["shape"])
    # As PyTorch recommends (DeviceMesh warns otherwise): bind LOCAL_RANK's
    # device first. (DeviceMesh's own binding is skipped on tpu: the
    # accelerator query in init_process_group() initializes the runtime, and
    # DeviceMesh binds only when torch.tpu.is_initialized() is False.)
    torch.tpu.set_device(int(os.environ["LOCAL_RANK"]))
    mesh = init_device_mesh("tpu", shape, mesh_dim_names=tuple(f"d{i}" for i in range(len(shape))))
    out = {"current_device": torch.tpu.current_device()}
    pg = dist.group.WORLD
    out["backends"] = {d: type(pg._get_backend(torch.device(d))).__name__ for d in ("tpu", "cpu")}
    value = torch.full((4,), float(rank + 1), device="tpu")
    sums = {}
    for i in range(len(shape)):
        t = value.clone()
        dist.all_reduce(t, group=mesh.get_group(i))
        sums[f"d{i}"] = t.cpu().tolist()
    out["sums"] = sums
    out["mesh"] = mesh.mesh.tolist()
    if world == 4:  # an explicit sub-group of ranks 0 and 2, tpu_dist by name
        sub = dist.new_group([0, 2], backend="tpu_dist")
        if rank in (0, 2):
            t = value.clone()
            dist.all_reduce(t, group=sub)
            out["sub"] = t.cpu().tolist()
    dist.barrier()
    dist.destroy_process_group()
    return out


def _child_env(rank, world, port):
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)}


def _env_child(fn, rank, world, env, args, out_dir):
    os.environ.update(env)
    os.environ.update(_child_env(rank, world, args["port"]))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    result = {"rank": rank}
    try:
        import torch_tpu  # noqa: F401

        result.update(fn(rank, world, args))
    except BaseException:  # noqa: BLE001
        result["error"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def run_env_job(tmp_path, fn, args, world, timeout=JOB_TIMEOUT_S):
    """Like run_job, but the processes start as torchrun's would (env:// with
    RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) and fn initializes."""
    ctx = multiprocessing.get_context("spawn")
    out_dir = tmp_path / "out"
    out_dir.mkdir(exist_ok=True)
    args = {**args, "port": _free_port()}
    env = {"TORCH_TPU_CPU_DEVICES": str(world)}
    procs = [ctx.Process(target=_env_child, args=(fn, r, world, env, args, str(out_dir))) for r in range(world)]
    _start_and_join(procs, timeout)
    results = []
    for r in range(world):
        path = out_dir / f"rank{r}.json"
        assert path.exists(), f"rank {r} exited with {procs[r].exitcode} and no result"
        res = json.loads(path.read_text())
        assert "error" not in res, f"rank {r} failed:\n{res['error']}"
        results.append(res)
    return results


def test_device_mesh_default_backend(tmp_path):
    results = run_env_job(tmp_path, _mesh_worker, {"shape": [2]}, world=2)
    for rank, res in enumerate(results):
        assert res["current_device"] == rank
        # init_process_group() with no backend on a tpu process: cpu:gloo,tpu:tpu_dist
        assert res["backends"] == {"tpu": "ProcessGroupTPU", "cpu": "ProcessGroupGloo"}
        assert res["sums"]["d0"] == [3.0] * 4


@full_tier
def test_device_mesh_2d_subgroups(tmp_path):
    results = run_env_job(tmp_path, _mesh_worker, {"shape": [2, 2]}, world=4)
    mesh = torch.tensor(results[0]["mesh"])
    for rank, res in enumerate(results):
        where = (mesh == rank).nonzero()[0].tolist()
        # dim 0 groups: the column through rank; dim 1: the row
        col = mesh[:, where[1]].tolist()
        row = mesh[where[0], :].tolist()
        assert res["sums"]["d0"] == [float(sum(r + 1 for r in col))] * 4
        assert res["sums"]["d1"] == [float(sum(r + 1 for r in row))] * 4
        if rank in (0, 2):
            assert res["sub"] == [4.0] * 4  # ranks 0 and 2: 1 + 3


# --------------------------------------------------------------------------
# failure: a dead rank, a rank that never joins the collective


def _failure_worker(rank, world, args):
    import torch.distributed as dist

    t = torch.ones(8, device="tpu")
    dist.all_reduce(t)  # both ranks are up
    if rank == 1:
        if args["how"] == "kill":
            os._exit(3)  # dies without a word
        time.sleep(args["pg_timeout_s"] + 15)  # alive, but never joins
        return {}
    time.sleep(1.0)
    start = time.monotonic()
    try:
        dist.all_reduce(t)
        t.cpu()
        return {"raised": False, "elapsed": time.monotonic() - start}
    except Exception as e:  # noqa: BLE001
        return {"raised": True, "type": type(e).__name__, "message": str(e)[:2000],
                "elapsed": time.monotonic() - start}


@pytest.mark.parametrize("how", ["kill", "timeout"])
def test_failure_raises_within_timeout(tmp_path, how):
    pg_timeout = 6
    job_timeout = pg_timeout + 60
    if how == "timeout":
        # rank 1 outlives rank 0 on purpose; the job waits for rank 0 only
        results = _run_failure(tmp_path, how, pg_timeout, job_timeout)
    else:
        results = run_job(tmp_path, _failure_worker, {"how": how, "pg_timeout_s": pg_timeout},
                          timeout=job_timeout, expect_exit={1})
    res = results[0]
    assert res["raised"], f"rank 0's all_reduce returned after {res['elapsed']:.1f} s with rank 1 {how}"
    assert res["type"] == "DistBackendError", res
    assert "tpu_dist allreduce failed on rank 0" in res["message"], res["message"]
    assert res["elapsed"] <= pg_timeout + 5, f"raised after {res['elapsed']:.1f} s (timeout {pg_timeout} s)"


def _run_failure(tmp_path, how, pg_timeout, job_timeout):
    ctx = multiprocessing.get_context("spawn")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    env = {"TORCH_TPU_CPU_DEVICES": "2"}
    args = {"how": how, "pg_timeout_s": pg_timeout}
    procs = [ctx.Process(target=_child, args=(_failure_worker, r, 2, str(tmp_path / "store"), str(out_dir), env, args))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        procs[0].join(job_timeout)
        assert not procs[0].is_alive(), f"rank 0 still running after {job_timeout} s (a hang)"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    res = json.loads((out_dir / "rank0.json").read_text())
    assert "error" not in res, res["error"]
    return [res]


# --------------------------------------------------------------------------
# DDP under torchrun, against a single-process run


def test_ddp_torchrun_matches_single_process():
    """examples/ddp_train.py under torchrun --nproc-per-node 2 (LOCAL_RANK
    picks the device, init_process_group() with no backend), strict then
    fused mode: per-step losses within 1e-5 relative of the single-process
    CPU run, parameters equal across ranks after every step (the example
    checks both and exits non-zero otherwise)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), os.path.join(root, "examples", "ddp_train.py"), "--mode", "both",
           "--steps", "4"]
    env = {**os.environ, "TORCH_TPU_CPU_DEVICES": "2", "GLOO_SOCKET_IFNAME": "lo"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        pytest.fail(f"torchrun still running after {JOB_TIMEOUT_S} s:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-4000:]
    assert "DDP on tpu (strict)" in out and "DDP on tpu (fused)" in out and "\nOK" in out, out[-4000:]


# --------------------------------------------------------------------------
# FSDP2 under torchrun, against a single-process run


def _torchrun(script, *args, timeout=JOB_TIMEOUT_S):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), os.path.join(root, "examples", script), *args]
    env = {**os.environ, "TORCH_TPU_CPU_DEVICES": "2", "GLOO_SOCKET_IFNAME": "lo"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        pytest.fail(f"torchrun {script} still running after {timeout} s:\n{out[-4000:]}")
    return proc.returncode, out


@pytest.fixture(scope="module")
def fsdp_run():
    return _torchrun("fsdp_train.py", "--steps", "4")


def test_fsdp2_matches_single_process(fsdp_run):
    """fully_shard per Linear and on the root, meta init + to_empty("tpu"),
    reshard_after_forward, Adam: per-step losses within 1e-5 relative of the
    single-process CPU run."""
    rc, out = fsdp_run
    assert rc == 0 and "LOSSES OK" in out, out[-4000:]


def test_fsdp2_sharded_memory(fsdp_run):
    """Per-rank torch.tpu.memory_allocated() of parameters + optimizer state
    after a step is at most 0.6x the unsharded model's: FSDP2 frees the
    unsharded parameters with untyped_storage().resize_(0)."""
    rc, out = fsdp_run
    line = next(ln for ln in out.splitlines() if "MEMORY RATIO" in ln)
    ratio = float(line.rsplit(" ", 1)[1])
    assert ratio <= 0.6, f"per-rank params + optimizer state {ratio:.3f}x the unsharded model's"


@full_tier
def test_two_nodes_on_localhost():
    """torchrun --nnodes 2 --node-rank R --rdzv-endpoint 127.0.0.1:PORT, one
    process per "node" (LOCAL_RANK 0 on both): DDP matches the single-process run."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    port = _free_port()
    env = {**os.environ, "TORCH_TPU_CPU_DEVICES": "2", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(r), "--nproc-per-node",
         "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes",
         os.path.join(root, "examples", "ddp_train.py"), "--steps", "3"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
        for r in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=JOB_TIMEOUT_S)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.communicate()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    assert "\nOK" in outs[0] or "\nOK" in outs[1], outs[0][-3000:]


# --------------------------------------------------------------------------
# FSDP2 mixed precision (bf16 parameters, f32 gradient reduction)

MP_DIM, MP_BATCH, MP_STEPS, MP_LR = 32, 8, 2, 1e-2


def _mp_model():
    import torch.nn as nn

    return nn.Sequential(nn.Linear(MP_DIM, 64), nn.Tanh(), nn.Linear(64, MP_DIM), nn.Tanh(), nn.Linear(MP_DIM, 4))


def _mp_init():
    torch.manual_seed(0)
    return {k: v.clone() for k, v in _mp_model().state_dict().items()}


def _mp_batch(step):
    g = torch.Generator().manual_seed(50 + step)
    return torch.randn(MP_BATCH, MP_DIM, generator=g), torch.randn(MP_BATCH, 4, generator=g)


def _mp_reference(world, steps):
    """FSDP2's mixed precision in one process on the CPU: per step and per
    rank's slice of the batch, the forward and backward run on bf16 copies of
    the f32 parameters (inputs cast to bf16, as MixedPrecisionPolicy's
    cast_forward_inputs); the bf16 gradients are cast to f32 and averaged
    (reduce_dtype f32, the reduce-scatter's AVG); Adam updates the f32
    parameters. Returns the per-step losses (mean of the ranks')."""
    import copy

    master = _mp_model()
    master.load_state_dict(_mp_init())
    opt = torch.optim.Adam(master.parameters(), lr=MP_LR)
    per = MP_BATCH // world
    losses = []
    for step in range(steps):
        x, y = _mp_batch(step)
        grads = [torch.zeros_like(p) for p in master.parameters()]
        total = 0.0
        for r in range(world):
            low = copy.deepcopy(master).to(torch.bfloat16)
            loss = torch.nn.functional.mse_loss(low(x[r * per:(r + 1) * per].bfloat16()), y[r * per:(r + 1) * per])
            loss.backward()
            for g, p in zip(grads, low.parameters()):
                g += p.grad.float() / world
            total += loss.item() / world
        for p, g in zip(master.parameters(), grads):
            p.grad = g
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def _fsdp_mp_worker(rank, world, args):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.tpu.set_device(rank)
    mesh = init_device_mesh("tpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with torch.device("meta"):
        model = _mp_model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    model.to_empty(device="tpu")
    full = _mp_init()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.to_local().copy_(full[name].chunk(world, dim=0)[rank])
    seen = {"forward_weight": set(), "grad": set(), "param": set()}
    model[0].register_forward_pre_hook(lambda m, a: seen["forward_weight"].add(str(m.weight.dtype)))
    opt = torch.optim.Adam(model.parameters(), lr=MP_LR)
    per = MP_BATCH // world
    losses = []
    for step in range(MP_STEPS):
        x, y = _mp_batch(step)
        x, y = (t[rank * per:(rank + 1) * per].to("tpu") for t in (x, y))
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        for p in model.parameters():
            seen["grad"].add(str(p.grad.dtype))
            seen["param"].add(str(p.dtype))
        opt.step()
        opt.zero_grad()
        total = loss.detach().float()
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
        losses.append(total.item())
    return {"losses": losses, **{k: sorted(v) for k, v in seen.items()}}


MP_RTOL = 1e-4  # bf16 kernels may round differently on tpu and CPU; measured <= 2e-7 on the CPU plugin


def test_fsdp2_mixed_precision_matches_single_process(tmp_path):
    """MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=f32) on 2 ranks:
    the forward sees bf16 weights, the sharded parameters and their gradients
    stay f32, and per-step losses are within MP_RTOL relative of the same
    mixed-precision arithmetic run in one process on the CPU."""
    results = run_job(tmp_path, _fsdp_mp_worker)
    ref = _mp_reference(WORLD, MP_STEPS)
    for res in results:
        assert res["forward_weight"] == ["torch.bfloat16"], res
        assert res["param"] == ["torch.float32"] and res["grad"] == ["torch.float32"], res
        for step, (a, b) in enumerate(zip(res["losses"], ref)):
            assert abs(a - b) <= MP_RTOL * abs(b), f"step {step}: FSDP2 bf16 loss {a} vs reference {b}"


# --------------------------------------------------------------------------
# torch.compile(backend="tpu") of a graph holding functional collectives


def _compiled_funcol_worker(rank, world, args):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    import torch_tpu

    group = dist.group.WORLD

    def f(x):
        y = funcol.all_reduce(x * 2, "sum", group)
        g = funcol.all_gather_tensor(y + 1, 0, group)
        s = funcol.reduce_scatter_tensor(g, "sum", 0, group)
        return s.sum(0) + y

    from torch_tpu import _dynamo as tpu_dynamo

    x = torch.arange(8, dtype=torch.float32).reshape(2, 4) + rank
    eager = f(x.to("tpu")).cpu()
    before = torch_tpu.metrics()["cpu_fallbacks"]
    stats = dict(tpu_dynamo.stats)
    fn = torch.compile(f, backend="tpu")
    compiled = fn(x.to("tpu")).cpu()
    again = fn(x.to("tpu") * 3).cpu()  # the compiled graph again, other values
    return {"equal": torch.equal(eager, compiled), "eager": eager.tolist(),
            "again_equal": torch.equal(again, f(x.to("tpu") * 3).cpu()),
            "programs": tpu_dynamo.stats["programs"] - stats["programs"],
            "eager_graphs": tpu_dynamo.stats["eager_graphs"] - stats["eager_graphs"],
            "fallbacks": {k: v for k, v in torch_tpu.metrics()["cpu_fallbacks"].items() if before.get(k) != v}}


def test_compiled_functional_collectives(tmp_path):
    """_c10d_functional all_reduce / all_gather_into_tensor /
    reduce_scatter_tensor inside a torch.compile(backend="tpu") graph: the
    values equal eager mode's (which the collective tests check against
    gloo), on every rank, with no CPU fallback. The graph is split at each
    collective: the computation between them runs as compiled programs
    (x * 2; y + 1; s.sum(0) + y), the collectives eagerly between them;
    nothing runs op by op."""
    results = run_job(tmp_path, _compiled_funcol_worker)
    for res in results:
        assert res["equal"] and res["again_equal"], res
        assert res["fallbacks"] == {}, res
        assert res["eager_graphs"] == 0 and res["programs"] == 3, res
    # on the CPU: y = 2 * sum_r x_r; each rank's reduce_scatter shard of the
    # gathered [y + 1; y + 1] is 2 * (y + 1)
    base = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    y = 2 * sum(base + r for r in range(WORLD))
    expect = (WORLD * (y + 1)).sum(0) + y
    for res in results:
        assert torch.equal(torch.tensor(res["eager"]), expect), (res["eager"], expect)



# --------------------------------------------------------------------------
# zero-copy: gloo on the tpu tensors' own buffer memory (the CPU plugin's
# buffers are host memory), against gloo on CPU tensors of the same values


def _zero_copy_worker(rank, world, args):
    import torch.distributed as dist

    import torch_tpu

    torch.tpu.set_device(rank)
    cpu_group = dist.new_group(backend="gloo")
    report = {"zero_copy": dist.group.WORLD._get_backend(torch.device("tpu")).zero_copy}
    seed = 100 + rank

    def transfers(fn):
        """fn() -> result; returns (result, tpu<->host bytes moved while it ran)."""
        torch.tpu.synchronize()
        m0 = torch_tpu.metrics()
        out = fn()
        torch.tpu.synchronize()
        m1 = torch_tpu.metrics()
        return out, sum(m1[k] - m0[k] for k in ("host_to_device_bytes", "device_to_host_bytes"))

    def check(name, got, want, moved=None, zero=True):
        try:
            for g, w in zip(got, want, strict=True):
                assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, w.dtype, g.shape, w.shape)
                assert torch.equal(g, w), f"tpu {g.flatten()[:6].tolist()} vs gloo {w.flatten()[:6].tolist()}"
            if moved is not None:
                assert (moved == 0) == zero, f"{moved} bytes moved between tpu and host (zero-copy expected: {zero})"
            report[name] = "ok"
        except Exception as e:  # noqa: BLE001 - one entry per case
            report[name] = f"{type(e).__name__}: {e}"

    x = torch.randint(-1000, 1000, (1000,), generator=torch.Generator().manual_seed(seed))
    xf = torch.randn(4096, generator=torch.Generator().manual_seed(seed))

    # all_reduce of a whole tensor, in place: no copies; the tensor keeps its storage
    t = x.to("tpu")
    ptr = t.data_ptr()
    _, moved = transfers(lambda: dist.all_reduce(t))
    c = x.clone()
    dist.all_reduce(c, group=cpu_group)
    check("all_reduce", [t.cpu()], [c], moved)
    report["same_storage"] = t.data_ptr() == ptr
    # AVG and PREMUL_SUM (host-side steps on the buffer's memory)
    t, c = xf.to("tpu"), xf.clone()
    _, moved = transfers(lambda: dist.all_reduce(t, op=dist.ReduceOp.AVG))
    dist.all_reduce(c, group=cpu_group)
    check("all_reduce_avg", [t.cpu()], [c.div_(world)], moved)
    t, c = xf.to("tpu"), xf * 0.5
    _, moved = transfers(lambda: dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5)))
    dist.all_reduce(c, group=cpu_group)
    check("all_reduce_premul", [t.cpu()], [c], moved)

    # a view into a larger storage: only its elements change
    base_c = x.clone()
    base = base_c.to("tpu")
    v = base[100:357]
    _, moved = transfers(lambda: dist.all_reduce(v, op=dist.ReduceOp.MAX))
    dist.all_reduce(base_c[100:357], op=dist.ReduceOp.MAX, group=cpu_group)
    check("view_in_larger_storage", [base.cpu()], [base_c], moved)

    # storages with capacity beyond numel (17 elements: the buffer holds more);
    # an op reading the whole tensor afterwards sees the reduced values
    for n in (17, 1001):
        c = x[:n].clone()
        t = c.to("tpu")
        _, moved = transfers(lambda: dist.all_reduce(t, op=dist.ReduceOp.MIN))
        dist.all_reduce(c, op=dist.ReduceOp.MIN, group=cpu_group)
        check(f"capacity_{n}", [t.cpu(), (t * 3 + 1).cpu(), t.flip(0).cpu()], [c, c * 3 + 1, c.flip(0)], moved)

    # an element read before (the host copy of the storage) is not stale after
    c = x.clone()
    t = c.to("tpu")
    first = t[0].item()
    dist.all_reduce(t)
    dist.all_reduce(c, group=cpu_group)
    check("element_read_after", [torch.tensor([first, t[0].item(), t[1].item()])], [torch.tensor([x[0].item(), c[0].item(), c[1].item()])])

    # a storage sharing its buffer with another storage (a whole-storage
    # copy_ takes the source's buffer): staged, the other one unchanged
    c = x.clone()
    t = c.to("tpu")
    u = torch.empty_like(t)
    u.copy_(t)
    _, moved = transfers(lambda: dist.all_reduce(t))
    dist.all_reduce(c, group=cpu_group)
    check("shared_buffer_staged", [t.cpu(), u.cpu()], [c, x], moved, zero=False)

    # non-contiguous: staged
    c = x[:600].reshape(20, 30).clone()
    t = c.to("tpu")
    _, moved = transfers(lambda: dist.all_reduce(t[:, ::3]))
    part = c[:, ::3].contiguous()  # (gloo itself mishandles a strided CPU tensor: it is given a dense one)
    dist.all_reduce(part, group=cpu_group)
    c[:, ::3] = part
    check("non_contiguous_staged", [t.cpu()], [c], moved, zero=False)

    # a program launched before the collective still reads the tensor: the
    # collective writes it only after that program is done
    a = torch.randn(768, 768, generator=torch.Generator().manual_seed(seed))
    t = a.to("tpu")
    torch.tpu.synchronize()
    m0 = torch_tpu.metrics()
    y = t @ t  # launched, in flight (no synchronize before the all_reduce)
    dist.all_reduce(t)
    torch.tpu.synchronize()
    m1 = torch_tpu.metrics()
    moved = sum(m1[k] - m0[k] for k in ("host_to_device_bytes", "device_to_host_bytes"))
    c = a.clone()
    dist.all_reduce(c, group=cpu_group)
    try:
        torch.testing.assert_close(y.cpu(), a @ a, rtol=1e-4, atol=1e-3)  # the values from before the all_reduce
        check("pending_reader", [t.cpu()], [c], moved)
    except AssertionError as e:
        report["pending_reader"] = f"AssertionError: {e}"

    # fused mode: the recorded region computing the tensor runs first
    torch_tpu.set_eager_mode("fused")
    try:
        c = x.clone()
        t = c.to("tpu")
        torch.tpu.synchronize()
        t.mul_(3).add_(1)  # recorded, not run
        w = t * 2           # recorded, reads t's value from before the collective
        m0 = torch_tpu.metrics()
        dist.all_reduce(t)
        m1 = torch_tpu.metrics()
        report["fused_moved"] = sum(m1[k] - m0[k] for k in ("host_to_device_bytes", "device_to_host_bytes"))
        c.mul_(3).add_(1)
        w_c = c * 2
        dist.all_reduce(c, group=cpu_group)
        check("fused_pending_region", [t.cpu(), w.cpu(), (t + 1).cpu()], [c, w_c, c + 1])
    finally:
        torch.tpu.synchronize()
        torch_tpu.set_eager_mode("strict")

    # broadcast: root reads its buffer, the others are written
    c = x.clone()
    t = c.to("tpu")
    _, moved = transfers(lambda: dist.broadcast(t, src=1))
    dist.broadcast(c, src=1, group=cpu_group)
    check("broadcast", [t.cpu()], [c], moved)

    # all_gather_into_tensor: the output written in place; also FSDP's form,
    # the input a view of the output
    c_out = torch.zeros(world * 1000, dtype=torch.int64)
    out = c_out.to("tpu")
    inp = x.to("tpu")
    _, moved = transfers(lambda: dist.all_gather_into_tensor(out, inp))
    dist.all_gather_into_tensor(c_out, x, group=cpu_group)
    check("all_gather_into_tensor", [out.cpu(), inp.cpu()], [c_out, x], moved)
    c_out = torch.zeros(world * 1000, dtype=torch.int64)
    c_out[rank * 1000:(rank + 1) * 1000] = x
    out = c_out.to("tpu")
    _, moved = transfers(lambda: dist.all_gather_into_tensor(out, out[rank * 1000:(rank + 1) * 1000]))
    c_ref = c_out.clone()
    dist.all_gather_into_tensor(c_ref, c_out[rank * 1000:(rank + 1) * 1000].clone(), group=cpu_group)
    check("all_gather_into_tensor_in_place", [out.cpu()], [c_ref], moved)

    # reduce_scatter_tensor: the input unchanged, the output written
    c_in = torch.randint(-1000, 1000, (world * 500,), generator=torch.Generator().manual_seed(seed + 1))
    inp = c_in.to("tpu")
    out = torch.zeros(500, dtype=torch.int64, device="tpu")
    _, moved = transfers(lambda: dist.reduce_scatter_tensor(out, inp))
    c_out = torch.zeros(500, dtype=torch.int64)
    dist.reduce_scatter_tensor(c_out, c_in.clone(), group=cpu_group)
    check("reduce_scatter_tensor", [out.cpu(), inp.cpu()], [c_out, c_in], moved)

    # the coalesced variants DDP and FSDP call (inputs and outputs uploaded
    # before: the collective moves nothing, the results' .cpu() their bytes)
    def coalesced(d, g, kind):
        ins = [x[:300].to(d), x[300:].to(d)]
        if kind == "all_reduce":
            return ins, []
        sizes = (world * 300, world * 700) if kind == "all_gather" else (150, 350)
        return ins, [torch.full((n,), -1, dtype=torch.int64).to(d) for n in sizes]

    def run_coalesced(g, kind, ins, outs):
        with dist._coalescing_manager(group=g, async_ops=True) as cm:
            for i, t in enumerate(ins):
                if kind == "all_reduce":
                    dist.all_reduce(t, group=g)
                elif kind == "all_gather":
                    dist.all_gather_into_tensor(outs[i], t, group=g)
                else:
                    dist.reduce_scatter_tensor(outs[i], t, group=g)
        cm.wait()
        return [t.cpu() for t in outs + ins]

    for kind in ("all_reduce", "all_gather", "reduce_scatter"):
        ins, outs = coalesced("tpu", None, kind)
        got, moved = transfers(lambda: run_coalesced(None, kind, ins, outs))
        want = run_coalesced(cpu_group, kind, *coalesced("cpu", cpu_group, kind))
        check(f"coalesced_{kind}", got, want)
        nbytes = sum(t.nbytes for t in got)
        if report[f"coalesced_{kind}"] == "ok" and moved != nbytes:
            report[f"coalesced_{kind}"] = f"{moved} bytes moved, expected {nbytes} (the results' download)"
    dist.barrier()
    # An upload written in place by a zero-copy all_reduce, then read by a
    # bucket program at another buffer size (a [2, n, 8] family whose bucket
    # buffer is 2 * 16 * 8 elements): the buffer is resized from the storage's
    # values after the collective, never from the bytes uploaded before it
    # (StorageBuffer::host, session 22).
    def f(z):
        return z * 2.5 - 1
    for n in (3, 5, 7, 9):
        for _ in range(2):
            f(torch.randn(2, n, 8, dtype=torch.float64).to("tpu")).cpu()
        torch_tpu.metrics()  # the bucket program compiled
    u = torch.randn(2, 6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    t = u.to("tpu")
    dist.all_reduce(t)
    c = u.clone()
    dist.all_reduce(c, group=cpu_group)
    check("all_reduce_then_bucket_read", [f(t).cpu()], [f(c)])
    # TORCH_TPU_DIST_ZERO_COPY: '0' makes a staged group, anything but '0'/'1' raises
    os.environ["TORCH_TPU_DIST_ZERO_COPY"] = "0"
    report["staged_group"] = dist.new_group(backend="tpu_dist")._get_backend(torch.device("tpu")).zero_copy
    os.environ["TORCH_TPU_DIST_ZERO_COPY"] = "yes"
    try:
        dist.new_group(backend="tpu_dist")
        report["bad_env"] = "no error"
    except RuntimeError as e:
        report["bad_env"] = str(e).splitlines()[0]
    finally:
        del os.environ["TORCH_TPU_DIST_ZERO_COPY"]
    return {"report": report}


ZERO_COPY_CASES = ("all_reduce", "all_reduce_avg", "all_reduce_premul", "view_in_larger_storage", "capacity_17",
                   "capacity_1001", "element_read_after", "shared_buffer_staged", "non_contiguous_staged",
                   "pending_reader", "fused_pending_region", "broadcast", "all_gather_into_tensor",
                   "all_gather_into_tensor_in_place", "reduce_scatter_tensor", "coalesced_all_reduce",
                   "coalesced_all_gather", "coalesced_reduce_scatter", "all_reduce_then_bucket_read")


@pytest.fixture(scope="module")
def zero_copy_reports(tmp_path_factory):
    return [r["report"] for r in run_job(tmp_path_factory.mktemp("zero-copy"), _zero_copy_worker)]


@pytest.mark.parametrize("case", ZERO_COPY_CASES)
def test_zero_copy_matches_gloo(zero_copy_reports, case):
    for rank, report in enumerate(zero_copy_reports):
        assert report[case] == "ok", f"rank {rank}: {case}: {report[case]}"


def test_zero_copy_keeps_storage(zero_copy_reports):
    assert all(r["zero_copy"] and r["same_storage"] for r in zero_copy_reports), zero_copy_reports


def test_zero_copy_setting(zero_copy_reports):
    for r in zero_copy_reports:
        assert r["staged_group"] is False
        assert "tpu_dist: TORCH_TPU_DIST_ZERO_COPY must be '0' or '1', got 'yes'" in r["bad_env"], r["bad_env"]
