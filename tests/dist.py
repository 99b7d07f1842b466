"""The distributed tests' harness: real gloo ranks on CPU (see parallel/spawn.py), and torchrun
launches whose output is captured in files."""
import subprocess

from parallel.spawn import Captured, free_port, run_captured, run_ranks  # noqa: F401


def two_nodes(args: list, env: dict, nproc_per_node: int, run_dir, timeout: float):
    """train_rl.py under two torchrun agents on this machine ('nodes' 0 and 1, a static
    rendezvous: node 0 holds the store); each agent's stderr, or None where they did not both end
    within `timeout` s. A hung run's ranks (each in a session of its own, torchrun's: their pid
    files under `run_dir`/pids) and agents are killed."""
    import contextlib
    import os
    import signal
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    port = free_port()
    agents = [Captured(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
         "--master-addr", "127.0.0.1", "--master-port", str(port), "--nproc-per-node",
         str(nproc_per_node), "train_rl.py", *args], cwd=root, env=env) for node in (0, 1)]
    try:
        return [a.communicate(timeout=timeout)[1] for a in agents], agents
    except subprocess.TimeoutExpired:
        return None, agents
    finally:
        if any(a.poll() is None for a in agents):
            for pid in (Path(run_dir) / "pids").glob("rank*.pid"):
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid.read_text()), signal.SIGKILL)
            for a in agents:
                a.kill()
