import pytest

from parallel import spawn
from tests import tiny

# Every run_ranks of the test process (the tests', and launch/calibrate.py's and the benches' that
# tests call) forks its ranks from the fork server, which imported torch once for the session:
# spawned, each rank imported it afresh (~3.5 s of 2 cores a call of three ranks; 518 -> 303 s
# for the 12 files of multi-rank tests).
spawn.START_METHOD = "forkserver"


@pytest.fixture(params=sorted(tiny.FAMILIES))
def family(request):
    return request.param
