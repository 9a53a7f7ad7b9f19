"""Drive `refinery serve` in a real browser: the curriculum deployment's run form filled and submitted the way a
person does it, the flow run followed to completion, then the run's HTML report opened.

    python tests/ui_browser.py --screenshots /tmp/ui-shots      # serve on a temp store and a free port

Method. Start `refinery serve` on a fresh store and a free port (or drive one already running: --url and
--store), launch the system Chromium through Playwright, then
  1. open the UI's Deployments page and click `curriculum`, then Run > Custom run;
  2. read every field of the form (its label path and the description shown under it) and compare the
     descriptions with the deployment's parameter schema: a field with none, or one whose description the UI's
     markdown renderer mangles (text in <angle brackets> is taken for HTML and dropped), is reported;
  3. submit it with rounds = 0 and check that it is refused, naming the field, with no run started; then fill it
     for the tiny random model, 1 round and a pool of 8 prompts, with every stage cut to its cheapest, check
     that every input shows what was typed, and submit;
  4. follow the flow run's page until Prefect's API reports a final state, then open its Artifacts tab;
  5. open <store>/_reports/run_id=<run>/index.html and check that it rendered: its heading names the run, and every
     plot image decoded (naturalWidth > 0);
then stop serve with `refinery serve --stop` (SIGINT, then SIGKILL to its process group, if that fails) and check
that none of its processes is left. A screenshot of each step goes to --screenshots; a JSON summary goes to
stdout and to <screenshots>/summary.json. Exit 0 when every check passed; 1 with one line naming the first
failure (the summary is still written); 2 for a usage error.

Choices, and why:
- Debian's Chromium at /usr/bin/chromium (`apt-get install chromium`), not Playwright's own build, which cannot
  be downloaded here. Flags: no sandbox (CI runs as root), no GPU, no QUIC, background networking, component
  updates or sync (nothing leaves 127.0.0.1), and a fresh profile folder each time.
- A field is addressed by its label path (config.Model.Policy), computed in the page from the nesting of the
  form's properties, because many fields share a label (Seed, Temperature, Batch Size). The page is re-tagged
  before each lookup: the form re-renders when a value changes.
- Choice inputs (Literal fields) open from the keyboard (focus, ArrowDown), as a keyboard user does: a mouse
  click on Prefect's select button did not open its options in headless Chromium 156.
- The run's state is read from the REST API, while the page shows the same run: the API gives an exact state
  name where the page gives a badge to parse.
- Serve's environment drops every PREFECT_* setting of the caller and REFINERY_STORE (a pytest session sets
  them) and has the worker poll every second, as tests/test_deploy.py does, so a run starts within seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
VIEWPORT = {"width": 1400, "height": 1000}

# What the form is filled with: the tiny random model (tests/test_curriculum.py's TINY), one round, a pool of
# 5 + 3 prompts from the first two default sources, and each stage at its cheapest.
NUMBERS = {
    "config.Rounds": 1,
    "config.Rollout.Group Size": 4, "config.Rollout.Max New Tokens": 4, "config.Rollout.Lope Max Groups": 2,
    "config.Rollout.Screen Samples": 0,  # full groups: the tiny random model never solves, so every screen would be dropped
    "config.Select.Batch Size": 6,
    "config.Refine.Max Children": 4, "config.Refine.Max Per Strategy": 2, "config.Teacher.Max New Tokens": 16,
    "config.Shape.Steps": 2, "config.Shape.Max Traces": 2, "config.Shape.Max New Tokens": 4,
    "config.Eval.N Samples": 2, "config.Eval.K": 2,
}
TEXTS = {"config.Model.Policy": "tiny-random"}
CHOICES = {"config.Model.Dtype": "fp32", "config.Select.Embedder": "hashing"}
SOURCE_SIZES = [5, 3]  # the sources kept, in order; the others are deleted with their trash button

# Tags every schema-form property with its label path, e.g. data-ui-path="config.Model.Policy".
TAG_FIELDS = """() => {
  const label = el => el.querySelector(':scope > .p-label__header .schema-form-property__label');
  const clean = t => t.replace(/\\s*\\(Optional\\)\\s*$/, '').trim();
  for (const el of document.querySelectorAll('.schema-form-property')) {
    const path = [];
    for (let a = el; a; a = a.parentElement ? a.parentElement.closest('.schema-form-property') : null) {
      if (label(a)) path.unshift(clean(label(a).textContent));
    }
    el.dataset.uiPath = path.join('.');
  }
}"""
# Every field as [label path, the description shown under its label ('' for none)].
READ_FIELDS = """() => [...document.querySelectorAll('.schema-form-property[data-ui-path]')].map(el => {
  const d = el.querySelector(':scope > .p-label__header .p-label__description');
  return [el.dataset.uiPath, d ? d.innerText.trim() : ''];
})"""
REPORT_STATE = """() => ({
  heading: document.querySelector('h1') ? document.querySelector('h1').innerText : '',
  byline: document.querySelector('h1 + p') ? document.querySelector('h1 + p').innerText : '',
  images: [...document.images].map(i => ({src: i.getAttribute('src'), width: i.naturalWidth})),
  tables: document.querySelectorAll('table').length,
})"""


class Failed(Exception):
    """A check that did not pass; the message is the one line printed."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _api(url: str, path: str, body: dict | None = None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + "/api" + path, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def _page_id(url: str) -> str:
    """The object id a UI page is about: the last part of its path (.../deployment/<id>?tab=Runs)."""
    return urllib.parse.urlsplit(url).path.rstrip("/").rsplit("/", 1)[-1]


def _norm(text: str) -> str:
    return " ".join(text.replace("`", "").split())


class Serve:
    """`refinery serve` as a child in a session of its own, stopped by `refinery serve --stop`."""

    def __init__(self, store: Path, port: int, log: Path):
        self.store, self.port, self.log = store, port, log
        self.url = f"http://127.0.0.1:{port}"
        # a user's shell, not the caller's: every PREFECT_* setting of a pytest session goes (an in-process CLI
        # call leaves PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL=CRITICAL behind, and the worker then never took
        # the submitted run), and so does REFINERY_STORE
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_") and k != "REFINERY_STORE"}
        self.env |= {"PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_WORKER_PREFETCH_SECONDS": "1",
                     "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        self.proc: subprocess.Popen | None = None
        self.seen: dict[int, object] = {}  # every descendant ever seen (psutil.Process), flow-run processes included

    def _cli(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "flows.cli", *args, "--store", str(self.store)]

    def start(self, timeout: float) -> float:
        t0 = time.monotonic()
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self._cli("serve", "--port", str(self.port)), cwd=ROOT, env=self.env,
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        while "ready in" not in self.log.read_text(errors="replace"):
            if self.proc.poll() is not None:
                raise Failed(f"refinery serve exited with code {self.proc.returncode} before it was ready; "
                             f"see {self.log}")
            if time.monotonic() - t0 > timeout:
                raise Failed(f"refinery serve was not ready after {timeout:.0f} s; see {self.log}")
            time.sleep(0.5)
        return time.monotonic() - t0

    def watch(self) -> None:
        """Note serve's descendants now (called while the flow run goes on, so its processes are seen too)."""
        import psutil

        with contextlib.suppress(psutil.Error):
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                self.seen.setdefault(p.pid, p)

    def stop(self) -> dict:
        """`refinery serve --stop`; then check the serve process exited 0 and none of its processes is left."""
        import psutil

        self.watch()
        t0 = time.monotonic()
        stop = subprocess.run(self._cli("serve", "--stop"), cwd=ROOT, env=self.env, capture_output=True, text=True,
                              timeout=180)
        try:
            rc = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # it did not stop in order: end its session ourselves
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            rc = self.proc.wait()
        left = []
        for p in self.seen.values():
            with contextlib.suppress(psutil.Error):  # is_running() also checks the pid was not reused
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(p.pid)
                    p.kill()
        return {"stop_exit": stop.returncode, "serve_exit": rc, "stop_s": round(time.monotonic() - t0, 1),
                "processes_left": left, "stop_output": (stop.stdout + stop.stderr).strip().splitlines()[-2:]}


class UI:
    """The Prefect UI in one Chromium page, with a screenshot per step."""

    def __init__(self, page, url: str, shots: Path):
        self.page, self.url, self.shots, self.taken = page, url, shots, []

    def shot(self, name: str, full_page: bool = False, whole_form: bool = False) -> None:
        """A PNG of the page; `whole_form`: of the whole run form, which scrolls inside the page (a full-page
        screenshot would show only the part in view), by making the window as tall as the form for a moment."""
        path = self.shots / f"{len(self.taken) + 1:02d}-{name}.png"
        if whole_form:
            height = self.page.evaluate("document.querySelector('form').scrollHeight")
            self.page.set_viewport_size({"width": VIEWPORT["width"], "height": min(height + 300, 16_000)})
            self.page.wait_for_timeout(300)  # let it lay out at the new size
        try:
            self.page.screenshot(path=str(path), full_page=full_page)
        finally:
            if whole_form:
                self.page.set_viewport_size(VIEWPORT)
        self.taken.append(path.name)

    def field(self, path: str, nth: int = 0):
        self.page.evaluate(TAG_FIELDS)
        loc = self.page.locator(f'[data-ui-path="{path}"]')
        if loc.count() <= nth:
            raise Failed(f"the run form has no field {path}" + (f" #{nth + 1}" if nth else ""))
        return loc.nth(nth)

    def set_number(self, path: str, value: float, nth: int = 0) -> None:
        box = self.field(path, nth).locator("input[type=number]").first
        box.fill(str(value))
        box.blur()  # the number input commits its value on change, as when a person tabs on

    def set_text(self, path: str, value: str) -> None:
        box = self.field(path).locator("textarea, input[type=text]").first
        box.fill(value)
        box.blur()

    def shown(self, path: str, nth: int = 0) -> str:
        return self.field(path, nth).locator("input, textarea").first.input_value()

    def choose(self, path: str, value: str) -> None:
        self.field(path).locator("button.p-select-button__control").first.focus()
        self.page.keyboard.press("ArrowDown")
        options = self.page.locator("[role=listbox] .p-select-option")
        options.first.wait_for(timeout=5000)
        options.filter(has_text=re.compile(rf"^\s*{re.escape(value)}\s*$")).first.click()
        shown = self.field(path).locator(".p-select-button__value")
        with contextlib.suppress(Exception):  # the button shows the choice on Vue's next render
            shown.filter(has_text=re.compile(rf"^\s*{re.escape(value)}\s*$")).wait_for(timeout=5000)
        if (text := shown.inner_text().strip()) != value:
            raise Failed(f"{path} shows {text!r} after choosing {value!r}")

    def set_optional_text(self, path: str, value: str) -> None:
        """An `X | None` field: switch it from None to its text input, then type."""
        self.field(path).get_by_role("button", name="str", exact=True).click()
        self.set_text(path, value)


def read_form(ui: UI, schema: dict) -> dict:
    """The form's fields with no description, and those whose shown description is not the schema's."""
    ui.page.evaluate(TAG_FIELDS)
    fields = ui.page.evaluate(READ_FIELDS)
    described = set()

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("description"), str):
                described.add(_norm(node["description"]))
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(schema)
    missing = sorted({path for path, text in fields if not text})
    mangled = sorted({f"{path}: shows {text!r}" for path, text in fields if text and _norm(text) not in described})
    return {"fields": len({path for path, _ in fields}), "without_description": missing, "mangled_description": mangled}


def fill_form(ui: UI, run_id: str) -> None:
    ui.set_optional_text("config.Run Id", run_id)
    items = '[data-ui-path="config.Pool.Sources"] .p-draggable-list__item'
    while (n := ui.page.locator(items).count()) > len(SOURCE_SIZES):  # from the end: the first are the easy ones
        ui.page.locator(items).nth(n - 1).locator(".schema-form-property-array-item__control > button").first.click()
        ui.page.wait_for_function("([sel, n]) => document.querySelectorAll(sel).length < n", arg=[items, n],
                                  timeout=5000)  # the trash button took the item away
    for i, size in enumerate(SOURCE_SIZES):
        ui.set_number("config.Pool.Sources.Size", size, nth=i)
    for path, value in TEXTS.items():
        ui.set_text(path, value)
    for path, value in CHOICES.items():
        ui.choose(path, value)
    for path, value in NUMBERS.items():
        ui.set_number(path, value)
    # the form shows what was typed (a value a re-render dropped would be submitted as the default)
    typed = {**{("config.Pool.Sources.Size", i): str(v) for i, v in enumerate(SOURCE_SIZES)},
             **{(p, 0): str(v) for p, v in {**TEXTS, **NUMBERS, "config.Run Id": run_id}.items()}}
    if wrong := [f"{p} shows {ui.shown(p, i)!r}, not {v!r}" for (p, i), v in typed.items() if ui.shown(p, i) != v]:
        raise Failed("the filled form lost values: " + "; ".join(wrong))


def refused(ui: UI, deployment_id: str) -> str:
    """Rounds = 0 (the schema's minimum is 1): the form must refuse to submit, say why, and start no run."""
    runs = {"deployments": {"id": {"any_": [deployment_id]}}}
    before = len(_api(ui.url, "/flow_runs/filter", runs))
    ui.set_number("config.Rounds", 0)
    ui.page.get_by_role("button", name="Submit").click()
    message = ui.page.locator(".p-toast__message:visible").filter(has_text="config.rounds").first
    message.wait_for(timeout=15_000)
    text = " ".join(message.inner_text().split())
    ui.page.wait_for_timeout(800)  # the toast slides in
    ui.shot("run-form-refused")
    for close in ui.page.locator(".p-toast__close-btn:visible").all():  # the toast would cover Submit
        with contextlib.suppress(Exception):
            close.click(timeout=2000)
    if "/run" not in ui.page.url or len(_api(ui.url, "/flow_runs/filter", runs)) != before:
        raise Failed(f"rounds = 0 was submitted (the form said {text!r})")
    return text


def follow_run(ui: UI, flow_run_id: str, timeout: float, watch=None) -> dict:
    t0, state = time.monotonic(), {}
    while time.monotonic() - t0 < timeout:
        if watch:
            watch()
        run = _api(ui.url, f"/flow_runs/{flow_run_id}")
        state = run.get("state") or {}
        if state.get("type") in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            break
        time.sleep(2)
    else:
        raise Failed(f"flow run {flow_run_id} still {state.get('name')} after {timeout:.0f} s")
    ui.page.reload()
    ui.page.get_by_text(state.get("name", ""), exact=True).first.wait_for(timeout=20_000)
    ui.page.wait_for_timeout(1000)
    return {"state": state.get("type"), "state_message": state.get("message"), "run_s": round(time.monotonic() - t0, 1)}


def check_report(ui: UI, report: Path, run_id: str) -> dict:
    if not report.is_file():
        raise Failed(f"no report at {report}")
    ui.page.goto(report.as_uri())
    ui.page.wait_for_load_state("load")
    seen = ui.page.evaluate(REPORT_STATE)
    ui.shot("report", full_page=True)
    broken = [i["src"] for i in seen["images"] if not i["width"]]
    if run_id not in seen["heading"]:
        raise Failed(f"the report's heading is {seen['heading']!r}, not run {run_id}")
    if not seen["images"] or broken:
        raise Failed(f"the report at {report} shows {len(seen['images'])} plots, broken: {', '.join(broken) or 'none'}")
    return {"path": str(report), "heading": seen["heading"], "byline": seen["byline"],
            "plots": [i["src"] for i in seen["images"]], "tables": seen["tables"]}


def drive(summary: dict, url: str, store: Path, shots: Path, run_id: str, run_timeout: float, watch=None) -> None:
    """Steps 1-5 against the serve at `url`, noting each step and its findings in `summary` (raises Failed on a
    failed check, or Playwright's error naming the step it hit)."""
    from playwright.sync_api import sync_playwright

    summary |= {"run_id": run_id, "url": url, "store": str(store)}
    with tempfile.TemporaryDirectory(prefix="ui-browser-profile-") as profile, sync_playwright() as pw:
        browser = pw.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, headless=True,
                                                        args=CHROMIUM_FLAGS, viewport=VIEWPORT)
        try:
            page = browser.new_page()
            page.set_default_timeout(90_000)  # generous: under `make test` another worker loads both cores
            ui = UI(page, url, shots)
            summary["screenshots"] = ui.taken
            summary["step"] = "open the Deployments page"
            page.goto(url + "/deployments")
            page.get_by_role("link", name="curriculum", exact=True).first.wait_for()
            ui.shot("deployments")
            page.get_by_role("link", name="curriculum", exact=True).first.click()
            page.wait_for_url("**/deployments/deployment/*")
            run_button = page.get_by_role("button", name="Run", exact=True)
            run_button.wait_for()
            page.wait_for_load_state("networkidle")
            ui.shot("curriculum-deployment")
            deployment_id = _page_id(page.url)
            summary["step"] = "open Run > Custom run"
            run_button.click()
            page.get_by_text("Custom run", exact=True).click()
            page.wait_for_url("**/run*")
            page.get_by_role("button", name="Submit").wait_for()
            page.locator('.schema-form-property').first.wait_for()
            ui.shot("run-form", whole_form=True)

            summary["step"] = "read the run form"
            schema = _api(url, f"/deployments/{deployment_id}")["parameter_openapi_schema"]
            summary["form"] = read_form(ui, schema)
            summary["step"] = "submit a value out of its bounds"
            summary["refused"] = refused(ui, deployment_id)
            summary["step"] = "fill the run form"
            fill_form(ui, run_id)
            ui.shot("run-form-filled", whole_form=True)
            summary["step"] = "submit the run form"
            run_name = f"{run_id}-{int(time.time())}"  # a name no earlier run of this serve has
            page.locator(".flow-run-name-input input").fill(run_name)
            page.get_by_role("button", name="Submit").click()
            page.wait_for_url(f"**/deployments/deployment/{deployment_id}*")  # back to its page
            page.get_by_role("link", name=run_name, exact=True).first.wait_for()
            ui.shot("submitted")
            page.get_by_role("link", name=run_name, exact=True).first.click()  # the new run: open its page
            page.wait_for_url("**/runs/flow-run/*")
            page.get_by_text("Task Runs", exact=True).first.wait_for()  # the run's own page has rendered
            flow_run_id = _page_id(page.url)
            summary |= {"flow_run_id": flow_run_id, "flow_run_name": run_name}
            page.wait_for_load_state("networkidle")
            ui.shot("flow-run")
            parameters = _api(url, f"/flow_runs/{flow_run_id}")["parameters"]["config"]
            summary["submitted"] = {"run_id": parameters.get("run_id"), "rounds": parameters.get("rounds"),
                                    "policy": parameters["model"]["policy"],
                                    "sources": [s["size"] for s in parameters["pool"]["sources"]]}
            summary["step"] = "follow the flow run"
            summary["flow_run"] = follow_run(ui, flow_run_id, run_timeout, watch)
            ui.shot("flow-run-final", full_page=True)
            if summary["flow_run"]["state"] != "COMPLETED":
                raise Failed(f"flow run {flow_run_id} ended {summary['flow_run']['state']}: "
                             f"{summary['flow_run']['state_message']}")
            summary["step"] = "open the run's artifacts"
            artifacts = _api(url, "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}})
            summary["artifacts"] = sorted(f"{a['type']}:{a.get('key') or a.get('description') or ''}"[:80]
                                          for a in artifacts)
            page.get_by_text("Artifacts", exact=True).first.click()
            page.wait_for_load_state("networkidle")
            page.wait_for_timeout(500)
            ui.shot("flow-run-artifacts", full_page=True)
            summary["step"] = "open the report"
            summary["report"] = check_report(ui, store / "_reports" / f"run_id={run_id}" / "index.html", run_id)
            summary["step"] = "done"
        except Exception:
            with contextlib.suppress(Exception):
                ui.shot("failure", full_page=True)
            raise
        finally:
            browser.close()


def _checks(summary: dict) -> str | None:
    """The first failed check of a finished drive, as one line; None when all passed."""
    form = summary.get("form", {})
    if form.get("without_description"):
        return f"{len(form['without_description'])} run-form fields show no description: " + \
            ", ".join(form["without_description"])
    if form.get("mangled_description"):
        return "run-form descriptions mangled by the UI's markdown (write <x> as `<x>`): " + \
            "; ".join(form["mangled_description"])
    submitted = summary.get("submitted", {})
    if submitted.get("rounds") != 1 or submitted.get("policy") != "tiny-random" or \
            submitted.get("sources") != SOURCE_SIZES:
        return f"the submitted parameters are not what the form was filled with: {submitted}"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ui_browser", description=__doc__.split("\n\n")[0])
    ap.add_argument("--screenshots", required=True, type=Path, help="folder for the PNGs and summary.json")
    ap.add_argument("--store", type=Path, help="the served store (default: a new temporary folder)")
    ap.add_argument("--url", help="drive a serve already running at this URL (with its --store) instead of "
                                  "starting one")
    ap.add_argument("--port", type=int, help="port for the serve this starts (default: a free one)")
    ap.add_argument("--run-id", default="ui-browser", help="the run id typed into the form")
    ap.add_argument("--run-timeout", type=float, default=300.0, help="seconds to wait for the flow run")
    args = ap.parse_args(argv)
    if args.url and not args.store:
        ap.error("--url needs --store, the folder that serve writes to")
    if not os.access(CHROMIUM, os.X_OK):
        print(f"ui_browser: error: no Chromium at {CHROMIUM} (apt-get install chromium)", file=sys.stderr)
        return 1
    args.screenshots.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # so `finally` stops serve
    t0 = time.monotonic()
    summary: dict = {}
    error = None
    with contextlib.ExitStack() as stack:
        store = args.store or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ui-browser-"))) / "store"
        serve = None
        try:
            url = args.url
            if not url:
                serve = Serve(store.resolve(), args.port or free_port(), args.screenshots / "serve.log")
                ready_s = serve.start(timeout=240)
                url = serve.url
            drive(summary, url.rstrip("/"), store.resolve(), args.screenshots, args.run_id, args.run_timeout,
                  serve.watch if serve else None)
            if serve:
                summary["serve_ready_s"] = round(ready_s, 1)
            error = _checks(summary)
        except Failed as e:
            error = str(e)
        except Exception as e:  # a Playwright timeout or a refused connection: one line, the step it hit
            error = f"{summary.get('step', 'start')}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        finally:
            if serve and serve.proc:
                summary["serve_stop"] = stopped = serve.stop()
                if error is None and (stopped["processes_left"] or stopped["serve_exit"] != 0):
                    error = (f"refinery serve --stop left processes {stopped['processes_left']} "
                             f"(serve exited {stopped['serve_exit']})")
    summary["total_s"] = round(time.monotonic() - t0, 1)
    summary["error"] = error
    (args.screenshots / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    if error:
        print(f"ui_browser: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
