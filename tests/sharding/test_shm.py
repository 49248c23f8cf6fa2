"""CPU page mapping: one virtual range stitched from pages of several shared-memory files shares their bytes."""

import os
import uuid

import pytest
import torch

from rollplex_trl.sharding.shm import PAGE, SharedFile, VirtualRange, backing_of


@pytest.fixture
def files():
    tag = uuid.uuid4().hex[:8]
    made = [SharedFile.create(f"/dev/shm/rollplex-test-{tag}-{i}", 2 * PAGE) for i in range(2)]
    yield made
    for f in made:
        f.close()


def test_stitched_range_is_zero_copy_in_any_order(files):
    a, b = files
    a.bytes().view(torch.int32).copy_(torch.arange(2 * PAGE // 4, dtype=torch.int32))
    b.bytes().view(torch.int32).copy_(-torch.arange(2 * PAGE // 4, dtype=torch.int32))
    rng = VirtualRange(3 * PAGE)
    rng.map(0, b, PAGE, PAGE)  # b's second page first, then a's two pages: not the files' order
    rng.map(PAGE, a, 0, 2 * PAGE)
    view = rng.bytes().view(torch.int32)
    n = PAGE // 4
    assert torch.equal(view[:n], b.bytes().view(torch.int32)[n:])
    assert torch.equal(view[n:], a.bytes().view(torch.int32))
    # Writes through either side are visible through the other: the same physical pages, nothing copied.
    a.bytes().view(torch.int32)[5] = 12345
    assert view[n + 5].item() == 12345
    view[3] = 777
    assert b.bytes().view(torch.int32)[n + 3].item() == 777
    assert backing_of(rng.addr) == (b.path, PAGE)
    assert backing_of(rng.addr + PAGE + 100) == (a.path, 100)
    rng.close()


def test_other_processes_see_the_same_pages(files):
    a, _ = files
    opened = SharedFile.open(a.path)
    a.bytes()[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    assert opened.bytes()[:4].tolist() == [1, 2, 3, 4]
    opened.close()
    assert os.path.exists(a.path)  # only the creator unlinks


def test_unaligned_mappings_are_refused(files):
    rng = VirtualRange(2 * PAGE)
    with pytest.raises(ValueError, match="unaligned"):
        rng.map(100, files[0], 0, PAGE)
    with pytest.raises(ValueError, match="unaligned"):
        rng.map(0, files[0], 100, PAGE)
    rng.close()
