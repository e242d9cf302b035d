"""The documentation: the MkDocs site builds strictly (broken links, unknown anchors, missing API
references and settings without a help text fail), the settings page lists every config field with
its help text, every module has an API entry, and the README stays short with working links."""
from __future__ import annotations

import ast
import html
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel, Field

from evolm_lib.config import CommonConfig, ESConfig, GRPOConfig

ROOT = Path(__file__).resolve().parents[1]
CONFIG_CLASSES = (CommonConfig, ESConfig, GRPOConfig)
README_MAX_WORDS = 1_200
"""A README read in five minutes (nanoGPT's is about 1,000 words)."""
DOC_MAX_LINES = {"docs/tuning.md": 400, "docs/measurements.md": 400, "docs/limitations.md": 160}
"""Reference pages, not logs: their longest allowed length."""
WORKSHOP = re.compile(r"\bleases?\b|\bleased\b|\blent machines?\b|\bdevice calls?\b|\brestart leases?\b|salvage|"
                      r"finish-by|claim-until", re.IGNORECASE)
"""How the project was built on borrowed machines, which the product (package, README, docs) never speaks of."""
GLOSSARY_TERMS = ("ES", "GRPO", "LoRA", "EGGROLL", "member", "population", "mean", "tiny-random", "BCa", "Holm",
                  "Hoy et al.", "Qiu et al.")
"""Terms the README uses that the glossary defines."""
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _load_hook():
    spec = importlib.util.spec_from_file_location("evolm_docs_hook", ROOT / "docs" / "hooks" / "evolm_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hook = _load_hook()


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site as `make docs-build` builds it (mkdocs build --strict), into a temporary folder."""
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    return out


def _page(site: Path, doc: str) -> str:
    """The built HTML of a docs page given by its path under docs/ (use_directory_urls)."""
    stem = doc.removesuffix(".md")
    path = site / (stem.removesuffix("index") if stem.endswith("index") else stem + "/") / "index.html"
    return path.read_text()


def _text(fragment: str) -> str:
    """Visible text of an HTML fragment: table cells apart, inline tags (code) dropped, whitespace collapsed."""
    cells = re.sub(r"</t[dh]>", " ", fragment)
    return " ".join(html.unescape(re.sub(r"<[^>]+>", "", cells)).split())


def _row(page: str, anchor: str) -> str:
    """The visible text of the table row that holds ``id="anchor"`` ('' when there is none)."""
    at = page.find(f'id="{anchor}"')
    if at < 0:
        return ""
    return _text(page[page.rfind("<tr", 0, at):page.index("</tr>", at)])


def _plain(help_text: str) -> str:
    """A help text as the page shows it: Markdown code marks gone, whitespace collapsed."""
    return " ".join(help_text.replace("`", "").split())


# --- the build -----------------------------------------------------------------------------------

def test_site_builds_strictly_with_every_page(site):
    for page in ("index.md", "getting-started.md", "settings.md", "measurements.md", "api/engines.md"):
        assert "<h1" in _page(site, page), page
    assert (site / "figures" / "demo_fitness.png").stat().st_size > 0  # figures/ published beside the pages


def test_settings_page_lists_every_field_with_its_help_text(site):
    page = _page(site, "settings.md")
    for cls in CONFIG_CLASSES:
        own = set(hook.own_fields(cls))
        for name in cls.model_fields:
            # a field is documented in its class's table, or (inherited unchanged) in the common one
            anchor = f"{hook.ANCHOR_PREFIX[cls.__name__]}-{name}" if name in own else f"common-{name}"
            row = _row(page, anchor)
            assert row, f"{cls.__name__}.{name}: no row with id {anchor!r} on the settings page"
            assert row.startswith(name + " ") and _plain(hook.help_text(cls, name)) in row, (cls.__name__, name, row)


def test_settings_page_shows_types_defaults_and_bounds(site):
    page = _page(site, "settings.md")
    assert _row(page, "es-sigma") == \
        "sigma float 0.05 > 0 noise std on LoRA weights (per_layer mode: a multiplier on each layer's mean |W|)"
    assert _row(page, "grpo-temperature").startswith("temperature float 1.0 > 0 sampling temperature of the rollouts")
    assert _row(page, "common-noise_device") == ""  # an ES-only field is not in the common table
    assert _row(page, "es-noise_device").startswith('noise_device "cpu" or "cuda" "cpu" where noise is drawn')


# --- help texts ----------------------------------------------------------------------------------

def test_every_config_field_has_a_help_text():
    for cls in CONFIG_CLASSES:
        assert hook.fields_without_help(cls) == [], cls.__name__


def test_help_texts_come_from_the_field_docstring_or_description_and_follow_the_mro():
    # the docstring under the field where it is declared (CommonConfig for ESConfig.model) ...
    assert hook.help_text(ESConfig, "model") == hook.help_text(CommonConfig, "model") == \
        "model name (smollm2-135m-instruct, tiny-random), local folder or hub name"
    # ... the subclass's own where it redeclares the field
    assert hook.help_text(CommonConfig, "temperature") == "sampling temperature for training rollouts (0: greedy)"
    assert hook.help_text(GRPOConfig, "temperature").startswith("sampling temperature of the rollouts (> 0")
    assert "temperature" in hook.own_fields(GRPOConfig) and "model" not in hook.own_fields(GRPOConfig)

    class Described(BaseModel):
        rate: float = Field(0.1, gt=0, description="step size, from the description")
        width: int = 3
        "width, from the docstring"

    assert hook.help_text(Described, "rate") == "step size, from the description"
    assert hook.help_text(Described, "width") == "width, from the docstring"
    assert hook.fields_without_help(Described) == []


def test_a_field_without_help_text_stops_the_settings_page():
    class Undocumented(BaseModel):
        documented: int = 1
        "has one"
        bare: int = 2

    assert hook.fields_without_help(Undocumented) == ["bare"]
    with pytest.raises(hook.MissingHelpText, match=r"Undocumented\.bare"):
        hook.check_help_texts([Undocumented])
    with pytest.raises(hook.MissingHelpText, match=r"Undocumented\.bare"):
        hook.settings_table(Undocumented, ["documented", "bare"])
    with pytest.raises(KeyError, match="Nonexistent"):
        hook.expand_markers("<!-- settings-table: Nonexistent -->", {"ESConfig": ESConfig})


def test_settings_table_cells_are_escaped_and_typed():
    class Tricky(BaseModel):
        mode: str = "a|b"
        "pipes | and * stars stay text"
        sizes: tuple[int, ...] = (1, 2)
        "a tuple default"

    table = hook.settings_table(Tricky, ["mode", "sizes"])
    assert '| `"a\\|b"` |' in table and "pipes \\| and \\* stars stay text" in table
    assert "| list of int | `1`, `2` |" in table
    assert hook.type_text(ESConfig.model_fields["noise_device"].annotation) == '`"cpu"` or `"cuda"`'
    assert hook.type_text(CommonConfig.model_fields["kv_cache_gb"].annotation) == "float or None"
    assert hook.constraint_text(CommonConfig.model_fields["gpu_memory_utilization"]) == "> 0, <= 1"


# --- the API reference ---------------------------------------------------------------------------

def _modules() -> list[str]:
    names = []
    for path in sorted((ROOT / "evolm_lib").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_every_module_has_an_api_entry(site):
    entries = set()
    for page in (ROOT / "docs" / "api").glob("*.md"):
        entries |= set(re.findall(r"^::: ([\w.]+)\s*$", page.read_text(), flags=re.M))
    missing = [name for name in _modules() if name not in entries]
    assert not missing, f"modules without an API entry: {missing} (add `::: NAME` to their layer's page in docs/api/)"
    built = "".join(_page(site, f"api/{page.name}") for page in (ROOT / "docs" / "api").glob("*.md"))
    assert all(f'id="{name}"' in built for name in _modules())


# --- the README ----------------------------------------------------------------------------------

def _words(text: str) -> int:
    """Words as `wc -w` counts them: runs of non-whitespace."""
    return len(text.split())


def _sections(text: str, level: str = "## ") -> dict[str, str]:
    """A Markdown page's sections by heading (at ``level``), code blocks left whole."""
    sections, heading, in_code = {}, None, False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if not in_code and line.startswith(level):
            heading = line[len(level):].strip()
            sections[heading] = ""
        elif heading is not None:
            sections[heading] += line + "\n"
    return sections


def test_readme_reads_in_five_minutes():
    words = _words((ROOT / "README.md").read_text())
    assert words <= README_MAX_WORDS, f"README.md has {words} words (at most {README_MAX_WORDS}); move detail into docs/"


def test_words_counted_as_wc_does():
    assert _words("make demo   # two\n\n| a | b |\n") == 9
    assert _sections("# T\n## A\nx\n```\n## not a heading\n```\n## B\ny\n") == \
        {"A": "x\n```\n## not a heading\n```\n", "B": "y\n"}


@pytest.mark.parametrize("page", sorted(DOC_MAX_LINES))
def test_reference_pages_stay_within_their_length(page):
    lines = len((ROOT / page).read_text().splitlines())
    assert lines <= DOC_MAX_LINES[page], f"{page} has {lines} lines (at most {DOC_MAX_LINES[page]}): a reference, not a log"


def _workshop_lines(paths) -> list[str]:
    found = []
    for path in paths:
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if line.startswith(":::"):  # an API reference line: the module's own text is checked in evolm_lib
                continue
            if WORKSHOP.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}")
    return found


@pytest.mark.parametrize("where", ["README.md", "docs", "evolm_lib"])
def test_the_product_does_not_speak_of_the_workshop(where):
    """No word of leases, lent machines, device calls, salvage or claim windows in what a user installs
    and reads: the README, the docs site, the package."""
    root = ROOT / where
    paths = [root] if root.is_file() else sorted(p for p in root.rglob("*")
                                                 if p.is_file() and p.suffix in (".md", ".py", ".yml", ".yaml", ".txt"))
    found = _workshop_lines(paths)
    assert not found, "workshop words in the product:\n" + "\n".join(found)


def test_the_workshop_pattern_finds_its_words_and_spares_others():
    for text in ("a lease's reply", "Leases", "two lent machines", "one device call", "restart lease 7",
                 "python -m evolm_lib.tune.salvage", "--finish-by EPOCH", "--claim-until"):
        assert WORKSHOP.search(text), text
    for text in ("releases the folder", "please pass the salt", "a restarted Ray engine", "packed q/k/v"):
        assert not WORKSHOP.search(text), text


def test_docs_hold_no_diary():
    """Reference pages say how the product works now: no session dates, no issue numbers."""
    found = []
    for path in sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\b20\d\d-\d\d-\d\d\b|\bissue \d+", line, flags=re.IGNORECASE):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}")
    assert not found, "dates or issue numbers in the docs:\n" + "\n".join(found)


def test_no_docs_page_repeats_a_heading():
    """A page says each thing once: two sections of one name would hold two texts of one subject."""
    for path in sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]):
        headings, in_code = [], False
        for line in path.read_text().splitlines():
            in_code ^= line.startswith("```")
            if not in_code and re.match(r"#{2,} ", line):
                headings.append(line.strip())
        repeated = sorted({h for h in headings if headings.count(h) > 1})
        assert not repeated, f"{path.relative_to(ROOT)} repeats {repeated}"


def test_each_measurement_names_its_command_machine_and_commit():
    """docs/measurements.md: every benchmark's current figure with the command, the card and the commit."""
    sections = _sections((ROOT / "docs" / "measurements.md").read_text())
    assert len(sections) >= 10, sorted(sections)
    for heading, body in sections.items():
        if heading == "The machines":
            continue
        for key in ("**Command:**", "**Machine:**", "**Commit:**"):
            assert key in body, f"measurements.md, {heading!r}: no {key}"
        assert re.search(r"\*\*Commit:\*\*\s+`[0-9a-f]{7,40}`", body), f"measurements.md, {heading!r}: the commit is not a hash"


def test_each_limitation_says_what_to_do_instead():
    """docs/limitations.md: one entry per limitation, what does not work and the workaround."""
    sections = _sections((ROOT / "docs" / "limitations.md").read_text())
    assert len(sections) >= 10, sorted(sections)
    missing = [heading for heading, body in sections.items() if body.count("**Instead:**") != 1]
    assert not missing, f"limitations without exactly one workaround: {missing}"


def test_readme_terms_are_in_the_glossary():
    readme = (ROOT / "README.md").read_text()
    assert "(docs/glossary.md)" in readme
    rows = [line for line in (ROOT / "docs" / "glossary.md").read_text().splitlines() if line.startswith("| **")]
    defined = {re.match(r"\| \*\*(.+?)\*\*", row).group(1) for row in rows}
    for term in GLOSSARY_TERMS:
        assert term in readme, f"the README does not use {term!r}: drop it from GLOSSARY_TERMS"
        assert term in defined, f"{term!r} is used in the README but not defined on the glossary page"


def test_readme_how_fast_gives_one_figure_per_row_on_one_named_card():
    section = _sections((ROOT / "README.md").read_text())["How fast"]
    before_table = section[:section.index("|")]
    assert "NVIDIA" in before_table, "the card is named once, above the table"
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]
    assert len(rows) >= 5
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert len(cells) == 2, f"one figure per row: {row}"
        assert "NVIDIA" not in row and "H100" not in row and "H200" not in row, f"the card is named above the table: {row}"
        assert len(re.findall(r"\d[\d,.]*(?:-\d[\d,.]*)?\s*(?:x|s|ms|%)", cells[1])) == 1, f"one figure per row: {row}"


def test_readme_api_snippets_call_what_the_classes_have():
    """One snippet per run class; every `run.NAME(...)` it calls is a method of that class, and its
    config is one the settings accept."""
    from evolm_lib import config as config_module
    from evolm_lib.train.es import ESRun
    from evolm_lib.train.grpo import GRPORun

    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    for cls in (ESRun, GRPORun):
        found = [block for block in blocks if f"{cls.__name__}.open(" in block]
        assert len(found) == 1, f"one snippet per run class: {cls.__name__}"
        called = set(re.findall(r"\brun\.(\w+)\(", found[0]))
        assert called, cls.__name__
        missing = sorted(name for name in called if not callable(getattr(cls, name, None)))
        assert not missing, f"the README's {cls.__name__} snippet calls {missing}, which {cls.__name__} does not have"
        call = next(node.value for node in ast.parse(found[0]).body
                    if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "config")
        settings = {keyword.arg: ast.literal_eval(keyword.value) for keyword in call.keywords}
        getattr(config_module, call.func.id)(**settings)  # raises where a setting is refused


def test_readme_links_resolve(site):
    links = [target for target in LINK.findall((ROOT / "README.md").read_text()) if "://" not in target]
    into_docs = [target for target in links if target.startswith("docs/")]
    assert len(into_docs) >= 10, into_docs  # the README points into the site
    for target in links:
        path, _, anchor = target.partition("#")
        assert (ROOT / path).is_file(), f"README.md links to {target}, which does not exist"
        if path.startswith("docs/") and path.endswith(".md"):
            page = _page(site, path.removeprefix("docs/"))  # published, not only present
            assert not anchor or f'id="{anchor}"' in page, f"README.md links to {target}: no such anchor"


def test_readme_make_targets_exist():
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
    named = set(re.findall(r"\bmake ([a-z][\w-]*)", (ROOT / "README.md").read_text()))
    assert {"demo", "test", "docs", "docs-build"} <= named
    assert named <= targets, named - targets


def test_the_layout_page_names_every_module_and_folder_of_the_library():
    """docs/layout.md is the map of the tree: a module or folder added without a line there fails here."""
    root = Path(__file__).resolve().parents[1]
    layout = (root / "docs" / "layout.md").read_text()
    missing = []
    for path in sorted((root / "evolm_lib").iterdir()):
        if path.name.startswith(("_", ".")) or path.name == "__pycache__":
            continue
        name = path.name + "/" if path.is_dir() else path.name
        if name not in layout:
            missing.append(name)
    for path in sorted((root / "evolm_lib").glob("*/*.py")):
        if path.name != "__init__.py" and path.parent.name in {"engines", "train", "es"} and path.name not in layout:
            missing.append(f"{path.parent.name}/{path.name}")
    assert not missing, f"docs/layout.md does not mention {missing}"


def test_the_committed_study_tables_rebuild_from_the_committed_rows_and_the_readme_quotes_them(tmp_path):
    """`evolm tune report` on each study's committed export (the tuned study, Qiu et al.'s protocol)
    gives its committed `summary.md` and CSV tables again, and every held-out score with its interval
    that the README quotes is one a `summary.md` gives: the findings cannot drift from the rows they
    rest on."""
    summaries = []
    for export, folder, table in (("tune_study_addition", "tuned_addition", "heldout.csv"),
                                  ("qiu_protocol_addition", "qiu_protocol", "sweep_equal_budget.csv")):
        committed = ROOT / "figures" / "study" / folder
        result = subprocess.run([sys.executable, "-m", "evolm_lib.cli", "tune", "report", f"figures/study/summaries/{export}",
                                 "--out", str(tmp_path / folder), "--no-figures"], capture_output=True, text=True,
                                cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
        assert result.returncode == 0, result.stderr
        assert str(tmp_path / folder / "summary.md") in result.stdout.splitlines()
        tables = sorted(p.name for p in committed.iterdir() if p.suffix in (".md", ".csv"))
        assert "summary.md" in tables and table in tables
        for name in tables:
            assert (tmp_path / folder / name).read_text() == (committed / name).read_text(), (folder, name)
        summaries.append((committed / "summary.md").read_text())
    readme = (ROOT / "README.md").read_text()
    quoted = re.findall(r"(\d+\.\d) % \((\d+\.\d)-(\d+\.\d)\)", readme)
    assert len(quoted) >= 6  # the tuned methods and the control; the protocol's
    for mean, low, high in quoted:
        assert any(f"{mean} % ({low}-{high} %)" in summary for summary in summaries), (mean, low, high)
