import pytest

from tests import tiny


@pytest.fixture(params=sorted(tiny.FAMILIES))
def family(request):
    return request.param
