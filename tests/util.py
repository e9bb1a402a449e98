import contextlib
import copy

import torch

import ccfx


@contextlib.contextmanager
def group_of_one(folder):
    """A gloo process group of this process alone (its file store in ``folder``): collectives
    trace and run on it, with no spawn."""
    import torch.distributed as dist

    # every test that makes a group destroys it: one still here was leaked by an earlier test
    assert not dist.is_initialized(), ("a process group is already initialised in this "
                                       "process: an earlier test did not destroy its group")
    dist.init_process_group("gloo", init_method=f"file://{folder / 'store'}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def compile_ccfx(model, fullgraph=False, dynamic=None, **options):
    options.setdefault("lowering", "eager")
    backend = ccfx.backend(**options)
    return torch.compile(model, backend=backend, fullgraph=fullgraph, dynamic=dynamic), backend


def loss_of(out):
    outs = out if isinstance(out, tuple) else (out,)
    return sum(o.float().square().mean() for o in outs if o.is_floating_point())


def run_both(model, *inputs, train_mode=True, **options):
    """Forward + backward in eager and through ccfx; returns (eager, ccfx) outputs, grads,
    and the backend."""
    eager = copy.deepcopy(model).train(train_mode)
    mine = copy.deepcopy(model).train(train_mode)
    compiled, backend = compile_ccfx(mine, **options)
    results = []
    for m, fn in ((eager, eager), (mine, compiled)):
        out = fn(*inputs)
        loss_of(out).backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        results.append((out, grads, {n: b.clone() for n, b in m.named_buffers()}))
    return results[0], results[1], backend


def assert_same(a, b, atol=1e-6, rtol=1e-6):
    (out_a, grads_a, bufs_a), (out_b, grads_b, bufs_b) = a, b
    torch.testing.assert_close(out_b, out_a, atol=atol, rtol=rtol)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], atol=atol, rtol=rtol,
                                   msg=lambda m, name=name: f"grad of {name}: {m}")
    for name in bufs_a:
        torch.testing.assert_close(bufs_b[name], bufs_a[name], atol=atol, rtol=rtol)
