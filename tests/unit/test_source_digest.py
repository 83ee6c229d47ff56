"""The digest that results carry names the code, not the copy's git metadata."""

import os

from fusion_pass.testing.source_digest import source_digest


def _tree(root, body: str) -> None:
    os.makedirs(os.path.join(root, "fusion_pass", "__pycache__"), exist_ok=True)
    with open(os.path.join(root, "fusion_pass", "a.py"), "w") as f:
        f.write(body)
    with open(os.path.join(root, "fusion_pass", "__pycache__", "a.pyc"), "w") as f:
        f.write(body * 2)


def test_the_digest_follows_the_code_and_ignores_caches(tmp_path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    _tree(a, "x = 1\n")
    _tree(b, "x = 1\n")
    assert source_digest(str(a)) == source_digest(str(b))
    with open(b / "fusion_pass" / "__pycache__" / "a.pyc", "w") as f:
        f.write("other")
    assert source_digest(str(a)) == source_digest(str(b))
    _tree(b, "x = 2\n")
    assert source_digest(str(a)) != source_digest(str(b))
    os.rename(b / "fusion_pass" / "a.py", b / "fusion_pass" / "b.py")
    _tree(b, "x = 1\n")  # the same bytes under two names is another tree
    assert source_digest(str(a)) != source_digest(str(b))
