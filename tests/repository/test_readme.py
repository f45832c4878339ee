"""The README's first example runs as printed (on the CPU: device strings swapped)."""

import os
import re

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def test_readme_api_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", open(README).read(), re.S)
    code = blocks[0]
    if not __import__("torch").cuda.is_available():
        code = code.replace('device="cuda"', 'device="cpu"').replace(".cuda()", "")
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert int(scope["report"].violations.sum()) == 0
    assert int(scope["report"].pages_checked.sum()) == 3
