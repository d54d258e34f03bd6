"""CUDA-graph runner for the SDM op on CuPy stream capture (SPEC §8).

    from sdm_cupy import graphs
    runner = graphs.GraphRunner("layer0")
    readings, bank, handle = runner.forward(param, wi, ww, v, beta, ri, rw, cfg, batch=B)
    grads = runner.backward(handle, grad_readings)

``runner.py`` holds the contract (keys, eager paths, tokens, lifetime); ``pools.py`` the
shared memory pools, stream ordering and regions; ``capture.py`` the capture mechanism (CUDA
graphs, or the host stand-in that runs the same bookkeeping on the CPU backend).
"""

from .capture import CupyCapture, HostCapture, HostOutOfMemory, HostStream
from .entry import BackwardHandle, ReplayedState, RunnerGradients
from .pools import region
from .runner import GraphRunner, graphs_suspended, reset_graphs, suspend_graphs

__all__ = ["GraphRunner", "ReplayedState", "BackwardHandle", "RunnerGradients",
           "reset_graphs", "suspend_graphs", "graphs_suspended", "region",
           "CupyCapture", "HostCapture", "HostOutOfMemory", "HostStream"]
