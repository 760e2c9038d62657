import pytest
import torch
from dist_pool import Pool


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def pools():
    """``pools(world)``: a spawned gloo group of that size, shared by every test of the session."""
    made: dict[int, Pool] = {}

    def get(world):
        if world not in made:
            made[world] = Pool(world)
        return made[world]

    yield get
    for p in made.values():
        p.close()
