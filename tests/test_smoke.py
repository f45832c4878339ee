import pytest
import torch

from util import Batch, assert_reports_equal, backends_under_test, tolerance


@pytest.mark.parametrize("backend", backends_under_test())
def test_decode_matches_reference(backend):
    batch = Batch.random(batch=3, num_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                         seq_lens=[1, 37, 80], dtype=torch.float16)
    out, lse, report = batch.decode(backend, return_lse=True)
    ref_out, ref_lse, ref_report = batch.reference(return_lse=True)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref_out, **tolerance(torch.float16))
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)
    assert_reports_equal(report, ref_report)
    assert int(report.violations.sum()) == 0
