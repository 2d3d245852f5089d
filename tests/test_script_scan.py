"""Whether a script uses nonstop, read from its source and its own modules' (no import run)."""

from __future__ import annotations

from nonstop.script_scan import uses_nonstop


def test_nonstop_is_found_in_the_script_or_any_module_of_its_own(tmp_path):
    (tmp_path / "direct.py").write_text("import nonstop\n")
    assert uses_nonstop(tmp_path / "direct.py")
    (tmp_path / "helpers.py").write_text("from nonstop import wrap\n")
    (tmp_path / "middle.py").write_text("import helpers\n")
    (tmp_path / "via.py").write_text("import middle  # which imports helpers, which uses nonstop\n")
    assert uses_nonstop(tmp_path / "via.py")
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "sub" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "sub" / "train.py").write_text("import nonstop.runtime\n")
    (tmp_path / "pkgd.py").write_text("from pkg.sub.train import main\n")
    assert uses_nonstop(tmp_path / "pkgd.py")


def test_a_script_that_does_not_use_nonstop_is_plain_whatever_its_modules_do(tmp_path):
    (tmp_path / "a.py").write_text("import b\nimport torch\n")
    (tmp_path / "b.py").write_text("import a\n")  # a circle of its own modules: followed once
    assert not uses_nonstop(tmp_path / "a.py")
    (tmp_path / "broken.py").write_text("def f(:\n")
    (tmp_path / "c.py").write_text("import broken\n")
    assert not uses_nonstop(tmp_path / "c.py")  # a module that does not parse: not followed
    (tmp_path / "d.py").write_text("import os.path\nfrom . import nothing\n")
    assert not uses_nonstop(tmp_path / "d.py")
    assert not uses_nonstop(tmp_path / "missing.py")
