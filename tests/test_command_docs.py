"""docs/commands.md is what the verbs' parsers print (tools/make_command_docs.py), and every verb is in it."""

from conftest import load_tool

docs = load_tool("make_command_docs")


def test_the_command_reference_is_the_parsers_help():
    from feduq.commands.main import VERBS

    text = docs.render()
    assert docs.OUT.read_text() == text, "docs/commands.md is stale: run python tools/make_command_docs.py"
    for v in VERBS:
        assert f"### feduq {v.name}\n" in text and f"usage: feduq {v.name}" in text, v.name
    assert "#### feduq convert nnunet-raw" in text and "usage: feduq convert nnunet-raw" in text
