"""hetflow's pages in Airflow's and MLflow's UIs as a user opens them in headless Chromium, for the UI
tests of both stacks: ``make up``'s (test_e2e_ui_airflow.py, test_e2e_ui_mlflow.py) and the compose
stack (test_e2e_compose_stack.py)."""

from __future__ import annotations

import re

CHROMIUM = "/usr/bin/chromium"
# What the form answers to -1 typed in Epochs (a number input would show NaN for the "-", then clamp).
EPOCHS_REFUSAL = 'invalid spec: epochs="-1" is invalid: expected an integer >= 1 and <= 1000'
# The saved chart view's first section in its order (hetflow/registry/charts_view.py), typed here: a
# check against that module's own constant would pass whatever order it held.
KEY_METRICS = ["test_accuracy", "val_accuracy", "train_accuracy", "test_loss", "val_loss", "train_loss"]
KEY_METRICS.append("examples_per_second")


def chromium():
    """Debian's Chromium, headless, driven through Playwright (no browser download): a module's
    ``browser`` fixture yields from it."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        yield browser
        browser.close()


def field(title: str) -> re.Pattern:
    """A form field by its title; required fields' labels end in " *"."""
    return re.compile(rf"^{title}\b")


def text_field(dialog, key: str):
    """The trigger form's text field of spec key ``key`` (numbers are typed as text too): Airflow's
    form does not link a text input to its label, so it is found by the id the form gives it."""
    return dialog.locator(f"#element_{key}")


def type_into(locator, text: str) -> None:
    """Empty a field, then type ``text`` into it one key at a time, as a person does."""
    locator.fill("")
    locator.press_sequentially(text)


def signed_in(browser, airflow_url: str, password: str, path: str):
    """A new page on Airflow's ``path``, signed in as admin through the login page."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(30_000)
    page.goto(f"{airflow_url}{path}")
    page.get_by_label("Username").fill("admin")
    page.get_by_label("Password").fill(password)
    page.get_by_role("button", name="Sign in").click()
    return page


def assert_on_screen_above(page, message, button) -> None:
    """``message`` is on screen without scrolling, right above ``button``, where the eye is after a click."""
    shown, under = message.bounding_box(), button.bounding_box()
    assert shown and under, (shown, under)
    assert 0 <= shown["y"] and shown["y"] + shown["height"] <= page.viewport_size["height"], shown
    assert 0 <= under["y"] - (shown["y"] + shown["height"]) <= 80, (shown, under)


def open_trigger_form(page):
    """The trigger form of the DAG ``page`` shows, and its Trigger button."""
    page.get_by_role("button", name="Trigger").first.click()
    dialog = page.get_by_role("dialog")
    return dialog, dialog.get_by_role("button", name="Trigger")


def refuse_epochs_typed_out_of_range(page, dialog, trigger):
    """Type -1 in Epochs and press Trigger: the value stays as typed, and the form names it and what
    is allowed right above the button. Returns the Epochs field."""
    # The sections are an accordion: opening one closes the others.
    dialog.get_by_text("Training", exact=True).click()
    epochs = text_field(dialog, "epochs")
    type_into(epochs, "-1")
    epochs.blur()
    assert epochs.input_value() == "-1"  # kept as typed: a number input shows NaN, then clamps to 1
    trigger.click()
    refusal = dialog.get_by_text(EPOCHS_REFUSAL)
    refusal.wait_for()
    assert_on_screen_above(page, refusal, trigger)
    return epochs


def dag_docs(page):
    """The Dag Docs dialog of the DAG ``page`` shows."""
    page.get_by_role("button", name="Dag Docs").click()
    return page.get_by_role("dialog")


def open_runs_page(page, runs_url: str, run_name: str) -> None:
    """``runs_url`` (the runs' link make up and make up-docker print) lists the run named ``run_name``:
    the experiment's training runs, not MLflow's GenAI view, which lists no run."""
    page.goto(runs_url)
    page.get_by_text(run_name).first.wait_for()


# The runs table's run names, sources and metric values that do not fit their cells ([column, text] each): the
# text's own width against the box that clips it (the cells cut with an ellipsis, which scrollWidth
# does not show).
_CUT_CELLS = """() => [...document.querySelectorAll(
    '[role=gridcell][col-id="attributes.`Run Name`"], [role=gridcell][col-id="attributes.`Source`"], ' +
    '[role=gridcell][col-id^="metrics."]')].flatMap(cell => {
    const shown = cell.querySelector('a') || cell.querySelector('.ag-cell-value');
    const text = document.createRange();
    text.selectNodeContents(shown);
    const cut = text.getBoundingClientRect().width > shown.getBoundingClientRect().width + 0.5;
    return cut ? [[cell.getAttribute('col-id'), shown.textContent]] : [];
})"""


def cut_cells(page) -> list[list[str]]:
    """The run names, sources and metric values MLflow's runs table shows cut (``_CUT_CELLS``)."""
    return page.evaluate(_CUT_CELLS)


# The texts of the leaf elements that read exactly one of ``names``, in the page's order.
_LEAF_TEXTS = """(names) => {
    const found = [];
    const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_ELEMENT);
    for (let e = walker.nextNode(); e; e = walker.nextNode()) {
        const text = e.textContent.trim();
        if (e.children.length === 0 && names.includes(text)) found.push(text);
    }
    return found;
}"""


def close_assistant_panel(page) -> None:
    """Close MLflow's Assistant side panel where it opened: MLflow opens it on a browser's first
    visit and remembers it closed, so a page that closed it before finds no Close button."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeoutError
    from playwright.sync_api import expect

    close = page.get_by_role("button", name="Close", exact=True)
    try:
        close.click(timeout=10_000)
    except PlaywrightTimeoutError:
        return
    expect(close).to_have_count(0)  # gone, and the page's content takes its width


def assert_key_metrics_first(page, charts_url: str, metrics: set[str]) -> None:
    """``charts_url`` (the key metrics' link) opens hetflow's saved chart view: its first section,
    Key metrics, holds KEY_METRICS in order; MLflow's own Model metrics section, after it, keeps the
    run's other metrics (``metrics``: all of them), epoch_seconds among them."""
    assert set(KEY_METRICS) <= metrics and {"epoch_seconds", "train_seconds"} <= metrics, sorted(metrics)
    page.set_viewport_size({"width": 1400, "height": 3200})  # the charts render once in view
    page.goto(charts_url)
    page.get_by_text("Key metrics", exact=True).wait_for()
    close_assistant_panel(page)
    page.get_by_text("epoch_seconds", exact=True).wait_for()
    shown = page.evaluate(_LEAF_TEXTS, ["Key metrics", "Model metrics", *sorted(metrics)])
    assert shown[: len(KEY_METRICS) + 2] == ["Key metrics", *KEY_METRICS, "Model metrics"], shown
    assert "epoch_seconds" in shown[len(KEY_METRICS) + 2 :], shown  # the other metrics keep their charts
    page.set_viewport_size({"width": 1400, "height": 1000})
