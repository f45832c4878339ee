"""The page-level writers in the forms an engine needs: an owner-scoped release (only pages the
ending lease still holds become FREE) and tags of many layers in one ``[num_layers, num_pages]``
array, reserved and released in one call. Each scoped case has a twin showing that the unscoped
release would have freed the page."""

import pytest
import torch

import kvattn
from kvattn import WriteDrop
from kvattn.tags import STATE_FREE, STATE_RESERVED, STATE_WRITTEN

LAYERS, PAGES = 3, 6
NOT_HELD, OOR = int(WriteDrop.NOT_HELD), int(WriteDrop.OUT_OF_RANGE)


def layer_tags():
    return torch.zeros(LAYERS, PAGES, dtype=torch.int64)


def test_reserve_sets_the_pages_of_every_layer_and_nothing_else():
    tags = layer_tags()
    kvattn.reserve_pages(tags, [1, 4], 7)
    want = torch.zeros_like(tags)
    want[:, [1, 4]] = kvattn.reserved_tag(7)
    assert torch.equal(tags, want)


def test_release_frees_the_pages_of_every_layer():
    tags = layer_tags()
    kvattn.reserve_pages(tags, [0, 1, 2], 7)
    result = kvattn.release_pages(tags, [0, 2])
    assert torch.equal(kvattn.tag_state(tags[:, 1]), torch.full((LAYERS,), STATE_RESERVED))
    assert (tags[:, [0, 2]] == kvattn.FREE_TAG).all()
    assert result.landed.all() and result.dropped_count() == 0


def test_each_layer_row_is_the_tag_array_a_reader_takes():
    tags = layer_tags()
    kvattn.reserve_pages(tags, [0], 5)
    k = torch.randn(PAGES, 4, 1, 8)
    result = kvattn.write_kv(k[0, :2], k[0, :2], k, k.clone(), torch.tensor([0, 1]), tags[1], 5)
    assert result.dropped_count() == 0
    assert kvattn.tag_state(int(tags[1, 0])) == STATE_WRITTEN
    assert int(tags[0, 0]) == int(tags[2, 0]) == kvattn.reserved_tag(5)


def test_scoped_release_frees_only_pages_the_owner_holds():
    tags = torch.zeros(PAGES, dtype=torch.int64)
    kvattn.reserve_pages(tags, [0, 1, 2], 7)
    kvattn.reserve_pages(tags, [1], 8)  # page 1 handed to the next lease before 7's release
    tags[2] = kvattn.written_tag(7, 3)
    result = kvattn.release_pages(tags, [0, 1, 2], owner=7)
    assert int(tags[0]) == int(tags[2]) == kvattn.FREE_TAG
    assert int(tags[1]) == kvattn.reserved_tag(8)
    assert result.landed.tolist() == [True, False, True]
    assert result.drop_reasons.tolist() == [0, NOT_HELD, 0] and result.dropped_count() == 1


def test_unscoped_release_twin_frees_the_page_the_next_lease_holds():
    tags = torch.zeros(PAGES, dtype=torch.int64)
    kvattn.reserve_pages(tags, [0, 1], 7)
    kvattn.reserve_pages(tags, [1], 8)
    kvattn.release_pages(tags, [0, 1])
    assert kvattn.tag_state(int(tags[1])) == STATE_FREE


def test_scoped_release_over_layers_is_per_layer():
    tags = layer_tags()
    kvattn.reserve_pages(tags, [3], 7)
    tags[1, 3] = kvattn.reserved_tag(9)  # one layer's copy of the page belongs to someone else
    result = kvattn.release_pages(tags, [3], owner=7)
    assert tags[:, 3].tolist() == [kvattn.FREE_TAG, kvattn.reserved_tag(9), kvattn.FREE_TAG]
    assert result.landed.tolist() == [True, False, True]


def test_scoped_release_owner_per_page():
    tags = torch.zeros(PAGES, dtype=torch.int64)
    kvattn.reserve_pages(tags, [0], 7)
    kvattn.reserve_pages(tags, [1], 8)
    result = kvattn.release_pages(tags, [0, 1], owner=torch.tensor([8, 8]))
    assert int(tags[0]) == kvattn.reserved_tag(7) and int(tags[1]) == kvattn.FREE_TAG
    assert result.landed.tolist() == [False, True]


def test_unchecked_out_of_range_pages_change_nothing_and_are_counted():
    tags = layer_tags()
    kvattn.reserve_pages(tags, [0], 7)
    before = tags.clone()
    kvattn.reserve_pages(tags, torch.tensor([PAGES]), 8, validate=False)
    result = kvattn.release_pages(tags, torch.tensor([-1]), owner=7, validate=False)
    assert torch.equal(tags, before)
    assert result.drop_reasons.tolist() == [OOR] * LAYERS


@pytest.mark.parametrize(
    "bad, error",
    [
        (torch.zeros(2, 3, 4, dtype=torch.int64), ValueError),
        (torch.zeros(LAYERS, PAGES, dtype=torch.int32), TypeError),
        (torch.zeros(PAGES, LAYERS, dtype=torch.int64).t(), ValueError),
        (torch.zeros(0, PAGES, dtype=torch.int64), ValueError),
    ],
)
def test_malformed_layer_tags_raise_naming_page_tags(bad, error):
    for call in (lambda: kvattn.reserve_pages(bad, [0], 1), lambda: kvattn.release_pages(bad, [0])):
        with pytest.raises(error, match="page_tags"):
            call()


def test_scoped_release_validates_the_owner():
    tags = torch.zeros(PAGES, dtype=torch.int64)
    with pytest.raises(ValueError, match="owner"):
        kvattn.release_pages(tags, [0], owner=0)
    with pytest.raises(ValueError, match="pages"):
        kvattn.release_pages(tags, [PAGES], owner=1)
