"""bench/sections.py, the only way a bench tool writes into a file it does not generate whole:
between its own markers, never elsewhere, and never by guessing (issue 18, item 9).
Run by `make bench-unit` (part of `make bench-smoke`, so of `make test`)."""

from __future__ import annotations

import pytest

from bench import REPO, report, sections
from bench.sections import SectionError

DOC = """# Title

See [docs/ETCD.md](docs/ETCD.md) for the data model; new key 463 req/s with 4.0 round trips.

<!-- bench:profile:begin -->
## Where the microseconds of a new key go

old numbers

<!-- bench:profile:end -->

## Targets

| etcd store | new key 463 req/s | reported |
"""


def test_put_replaces_only_what_lies_between_the_markers():
    new = sections.put(DOC, "profile", "## Where the microseconds of a new key go\n\nnew numbers\n")
    begin, end = sections.markers("profile")
    before, after = DOC.split(begin)[0], DOC.split(end)[1]
    assert new.startswith(before + begin + "\n") and new.endswith(end + after)
    assert "old numbers" not in new and "new numbers" in new
    assert sections.get(new, "profile") == "## Where the microseconds of a new key go\n\nnew numbers\n\n"
    # the same content again changes nothing; an empty section keeps its markers
    assert sections.put(new, "profile", sections.get(new, "profile")) == new
    emptied = sections.put(DOC, "profile", "")
    assert begin + "\n" + end in emptied and sections.get(emptied, "profile") == ""


def test_a_file_without_the_markers_is_refused_not_guessed_at():
    # the README: headings and numbers a pattern could match, but no markers of this section
    readme = DOC.replace(sections.markers("profile")[0] + "\n", "").replace(sections.markers("profile")[1] + "\n", "")
    assert sections.get(readme, "profile") is None
    with pytest.raises(SectionError, match="no <!-- bench:profile:begin -->"):
        sections.put(readme, "profile", "new key 463 req/s")
    with pytest.raises(SectionError):
        sections.put(DOC, "size", "x")


@pytest.mark.parametrize("broken", [
    DOC.replace("<!-- bench:profile:end -->\n", ""),                                  # end missing
    DOC.replace("<!-- bench:profile:begin -->\n", ""),                                # begin missing
    DOC + "<!-- bench:profile:begin -->\n",                                           # begin twice
    DOC + "<!-- bench:profile:end -->\n",                                             # end twice
    DOC.replace("<!-- bench:profile:begin -->", "<!-- bench:profile:END -->")
       .replace("<!-- bench:profile:end -->", "<!-- bench:profile:begin -->")
       .replace("<!-- bench:profile:END -->", "<!-- bench:profile:end -->"),         # out of order
    DOC.replace("<!-- bench:profile:begin -->\n", "text <!-- bench:profile:begin -->\n"),  # not a line
])
def test_broken_markers_are_refused_for_reading_and_writing(broken):
    with pytest.raises(SectionError):
        sections.get(broken, "profile")
    with pytest.raises(SectionError):
        sections.put(broken, "profile", "x")


def test_content_cannot_smuggle_markers_and_names_are_plain():
    with pytest.raises(SectionError):
        sections.put(DOC, "profile", "<!-- bench:profile:end -->\nmore")
    for name in ("", "Profile", "a b", "x-->", "../x"):
        with pytest.raises(SectionError):
            sections.markers(name)


def test_block_is_what_put_expects():
    doc = "a\n\n" + sections.block("wake", "## Wake\n\nnumbers") + "\nz\n"
    assert sections.get(doc, "wake") == "## Wake\n\nnumbers\n\n"
    assert sections.put(doc, "wake", "## Wake\n\nnumbers") == doc
    assert sections.get(sections.block("fill", ""), "fill") == ""


@pytest.mark.parametrize("doc", ["README.md", "docs/OPERATIONS.md"])
def test_update_file_leaves_a_file_without_markers_untouched(tmp_path, doc):
    # docs/OPERATIONS.md holds the README's former Performance section (issue 21, section 4)
    path = tmp_path / "doc.md"
    text = (REPO / doc).read_text()
    path.write_text(text)
    with pytest.raises(SectionError):
        sections.update_file(path, report.PROFILE_SECTION, "new key 463 req/s")
    assert path.read_text() == text


def test_benchmarks_md_has_each_owned_section_once_and_the_readme_and_docs_none():
    benchmarks = (REPO / "BENCHMARKS.md").read_text()
    # the README and docs/ (docs/OPERATIONS.md holds the performance summary since issue 21, section 4)
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    assert REPO / "docs" / "OPERATIONS.md" in docs
    for name in (report.FILL_SECTION, report.MEMORY_SECTION, report.PROFILE_SECTION, report.SIZE_SECTION,
                 report.WAKE_SECTION, report.WAKE_FLEET_SECTION, report.CALLOUT_FLOOR_SECTION,
                 report.AB_SECTION):
        assert sections.span(benchmarks, name) is not None, name
        for doc in docs:
            assert sections.get(doc.read_text(), name) is None, (doc, name)
    for doc in docs:
        assert "<!-- bench:" not in doc.read_text(), doc


def test_the_memory_samples_go_to_a_csv_not_into_the_report(tmp_path):
    """Issue 21 §4: BENCHMARKS.md keeps its summary tables; the raw RSS samples are a CSV."""
    from bench.report_memory import SAMPLES_CSV, write_samples

    samples = [{"t": i * 2.0, "requests": i * 100, "rss_kib": 1000 + i, "stored": i, "store_full": 0, "swept": 0}
               for i in range(100)]
    path = write_samples({"samples": samples}, tmp_path)
    lines = path.read_text().splitlines()
    assert path == tmp_path / SAMPLES_CSV
    assert lines[0] == "t_s,requests,rss_kib,stored,store_full,swept"
    assert len(lines) == 101 and lines[-1] == "198.00,9900,1099,99,0,0"
