"""The docs generated from the code (tools/make_docs.py): docs/reference/commands.md is what the verbs' parsers print, with
every verb in it; docs/reference/development.md's layout is the package's folders and modules."""

from conftest import load_tool

docs = load_tool("make_docs")


def test_the_command_reference_is_the_parsers_help():
    from feduq.commands.main import VERBS

    text = docs.render()
    assert docs.OUT.read_text() == text, "docs/reference/commands.md is stale: run python tools/make_docs.py"
    for v in VERBS:
        assert f"### feduq {v.name}\n" in text and f"usage: feduq {v.name}" in text, v.name
    assert "#### feduq convert nnunet-raw" in text and "usage: feduq convert nnunet-raw" in text


def test_the_development_layout_lists_every_folder_and_module_of_the_package():
    text = docs.development_text()
    assert docs.DEVELOPMENT.read_text() == text, "docs/reference/development.md's layout is stale: run python tools/make_docs.py"
    layout = docs.layout()
    for folder in (p for p in docs.PACKAGE.rglob("*") if p.is_dir() and "__pycache__" not in p.parts):
        assert folder.relative_to(docs.PACKAGE).as_posix() + "/ " in layout, folder
        for module in folder.glob("*.py"):
            if module.name != "__init__.py":
                assert module.stem in layout, module
