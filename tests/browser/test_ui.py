#!/usr/bin/env python3
"""The web pages in a real browser (headless Chromium through Selenium), against
`rlserve serve` on the default model. Run by .ci/run after the Rust tests:

    python3 tests/browser/test_ui.py [--rlserve target/debug/rlserve] [--out DIR]

Three servers (ports 8451-8453): feedback learning on (an update every 3 rated samples),
feedback on with an admin key, and feedback off. Checks, each printed as it passes:
  1. chat: a typed message gets a streamed answer with its policy version; thumbs up puts
     that answer's id and reward 1 in feedback.jsonl;
  2. compare mode: two answers side by side; preferring one stores the chosen/rejected
     pair; with the 3 samples an update runs and the status line's policy version moves
     from v0 to v1 without a reload;
  3. dashboard: a job started from the page's form runs its 2 steps and the reward chart
     gets one point per step; a longer job is stopped from its Stop button;
  4. errors: with a wrong admin key a rating shows a visible 401 message; with feedback
     off the status line says so and the rating buttons are disabled.
Screenshots (chat and dashboard at 1280×800, the chat at 390×844) go to --out (default
tests/browser/screenshots/, not committed). Exits non-zero on the first failure.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

# Selenium finds the system browser and driver by path: no download attempt.
os.environ.setdefault("SE_OFFLINE", "true")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def log(msg):
    print(f"[ui] {msg}", flush=True)


class Server:
    """`rlserve serve --port PORT ARGS` with its jobs (and, with `--learn-from-feedback`, its
    feedback) in a temporary folder."""

    def __init__(self, rlserve, port, *args):
        self.port = port
        self.base = f"http://127.0.0.1:{port}"
        self.dir = tempfile.mkdtemp(prefix=f"rlserve-ui-{port}-")
        cmd = [rlserve, "serve", "--port", str(port), "--jobs-dir", os.path.join(self.dir, "jobs"), *args]
        if "--learn-from-feedback" in args:
            cmd += ["--feedback-dir", os.path.join(self.dir, "feedback")]
        self.logf = open(os.path.join(self.dir, "serve.log"), "w")
        self.proc = subprocess.Popen(cmd, stdout=self.logf, stderr=subprocess.STDOUT, cwd=ROOT)
        for _ in range(600):
            try:
                urllib.request.urlopen(f"{self.base}/health", timeout=1)
                return
            except Exception:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.5)
        tail = open(self.logf.name).read()[-2000:]
        self.stop()
        sys.exit(f"rlserve {' '.join(args)} did not start: {tail}")

    def stop(self):
        """Stops the server and removes its folder (feedback checkpoints: 1.6 GB a run)."""
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.logf.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def browser(width=1280, height=800):
    o = webdriver.ChromeOptions()
    o.binary_location = shutil.which("chromium") or shutil.which("chromium-browser") or "/usr/bin/chromium"
    for a in ["--headless=new", "--no-sandbox", "--disable-dev-shm-usage", f"--window-size={width},{height}"]:
        o.add_argument(a)
    service = webdriver.ChromeService(executable_path=shutil.which("chromedriver") or "/usr/bin/chromedriver")
    d = webdriver.Chrome(options=o, service=service)
    d.set_window_size(width, height)
    return d


def wait(d, what, cond, timeout=120):
    try:
        # The page redraws its messages as tokens stream in: an element read mid-redraw is
        # stale, and the condition is simply tried again.
        w = WebDriverWait(d, timeout, poll_frequency=0.25, ignored_exceptions=[StaleElementReferenceException])
        return w.until(lambda _: cond())
    except Exception:
        shot = os.path.join(tempfile.gettempdir(), "rlserve-ui-failure.png")
        d.save_screenshot(shot)
        logs = [e["message"] for e in d.get_log("browser")]
        sys.exit(f"FAILED: {what} (waited up to {timeout} s); notice: {notice(d)!r}; browser log: {logs}; screenshot {shot}")


def notice(d):
    el = d.find_element(By.ID, "notice")
    return el.text if el.is_displayed() else ""


def feedback_lines(path):
    if not os.path.exists(path):
        return []
    return [json.loads(l) for l in open(path) if l.strip()]


def set_field(d, id_, value):
    """A settings field (in the collapsed settings panel) set as a user's edit would."""
    el = d.find_element(By.ID, id_)
    d.execute_script("arguments[0].value = arguments[1]; arguments[0].dispatchEvent(new Event('change'))", el, str(value))


def retry(action, tries=40):
    """`action()`, again while it touches an element a redraw replaced (stale)."""
    for i in range(tries):
        try:
            return action()
        except StaleElementReferenceException:
            if i == tries - 1:
                raise
            time.sleep(0.1)


def answer(d, rid):
    """The assistant message with response id `rid`, looked up afresh."""
    return d.find_element(By.CSS_SELECTOR, f'.msg.assistant[data-id="{rid}"]')


def answers_done(d):
    msgs = d.find_elements(By.CSS_SELECTOR, ".msg.assistant")
    if not msgs or not msgs[-1].get_attribute("data-id"):
        return None
    return msgs[-1] if not d.find_element(By.ID, "stop").is_displayed() else None


def ask(d, text):
    box = d.find_element(By.ID, "input")
    box.send_keys(text)
    d.find_element(By.ID, "send").click()
    # The answer streams: its text shows before the request ends.
    wait(d, "a streamed answer appears", lambda: any(
        e.text.strip() for e in d.find_elements(By.CSS_SELECTOR, ".msg.assistant .markdown")))
    return wait(d, "the answer finishes", lambda: answers_done(d) and answers_done(d).get_attribute("data-id"))


def open_chat(d, base, max_tokens, key=None):
    """The chat page of `base` as a first visit (nothing stored but `key`), sampling at T = 1
    (a rated answer must not be greedy) with at most `max_tokens`."""
    d.get(base + "/")
    d.execute_script("localStorage.clear(); if (arguments[0]) localStorage.setItem('rlserve.key', arguments[0])", key)
    d.get(base + "/")
    set_field(d, "max_tokens", max_tokens)
    set_field(d, "temperature", 1)


def chat_checks(srv, out):
    d = browser()
    open_chat(d, srv.base, 24)
    wait(d, "the status line shows policy v0", lambda: d.find_element(By.ID, "status").get_attribute("data-version") == "0")
    rid = ask(d, "Write one sentence about the sea.")
    version = retry(lambda: answer(d, rid).find_element(By.CSS_SELECTOR, ".version").text)
    assert version == "policy v0", version
    text = retry(lambda: answer(d, rid).find_element(By.CSS_SELECTOR, ".markdown").text)
    log(f"1. streamed answer {rid} ({version}): {text[:60]!r}")
    retry(lambda: answer(d, rid).find_element(By.CSS_SELECTOR, "button.rate.up").click())
    path = os.path.join(srv.dir, "feedback", "feedback.jsonl")
    wait(d, "the rating reaches feedback.jsonl", lambda: any(l["id"] == rid for l in feedback_lines(path)), 30)
    line = [l for l in feedback_lines(path) if l["id"] == rid][0]
    assert line["ratings"] == [[0, 1.0]], line
    wait(d, "the rated button shows it", lambda: d.find_elements(By.CSS_SELECTOR, ".msg.assistant button.rate.up.rated"))
    log(f"1. thumbs up stored: {line['ratings']} for {rid}")
    d.save_screenshot(os.path.join(out, "chat.png"))

    d.find_element(By.ID, "compare").click()
    rid2 = ask(d, "Name a colour.")
    cols = retry(lambda: len(answer(d, rid2).find_elements(By.CSS_SELECTOR, ".answer")))
    assert cols == 2, cols
    retry(lambda: answer(d, rid2).find_element(By.CSS_SELECTOR, ".answer.col1 button.prefer").click())
    wait(d, "the pair reaches feedback.jsonl", lambda: any(l["id"] == rid2 for l in feedback_lines(path)), 30)
    pair = [l for l in feedback_lines(path) if l["id"] == rid2][0]
    assert pair.get("pair") is True and sorted(pair["ratings"]) == [[0, 0.0], [1, 1.0]], pair
    log(f"2. compare: preference pair stored for {rid2}: {pair['ratings']}")
    wait(d, "the policy version moves to v1 without a reload",
         lambda: d.find_element(By.ID, "status").get_attribute("data-version") == "1", 300)
    log(f"2. status line after the update: {d.find_element(By.ID, 'status').text!r}")
    d.save_screenshot(os.path.join(out, "chat-compare.png"))
    d.set_window_size(390, 844)
    time.sleep(0.5)
    d.save_screenshot(os.path.join(out, "chat-phone.png"))
    d.quit()


def dashboard_checks(srv, out):
    d = browser()
    d.get(srv.base + "/dashboard")
    wait(d, "the engine charts draw", lambda: int(d.find_element(By.CSS_SELECTOR, '[data-chart="requests"]').get_attribute("data-points")) >= 2, 30)
    config = {"dataset": "builtin:arithmetic", "max_steps": 2, "prompts_per_step": 2, "num_generations": 4,
              "learner": {"max_completion_length": 12}}
    d.find_element(By.CSS_SELECTOR, "#start summary").click()
    area = d.find_element(By.ID, "config")
    area.clear()
    area.send_keys(json.dumps(config))
    d.find_element(By.ID, "start-job").click()
    title = lambda: d.find_element(By.ID, "job-title").text
    wait(d, "the job runs to completion", lambda: ": completed," in title(), 600)
    points = retry(lambda: d.find_element(By.CSS_SELECTOR, '[data-chart="reward"]').get_attribute("data-points"))
    assert points == "2", f"reward chart has {points} points for 2 steps"
    log(f"3. dashboard job: {title()!r}, reward chart points {points}")
    d.find_element(By.CSS_SELECTOR, "#start summary").click()
    d.execute_script("document.getElementById('job').scrollIntoView()")
    time.sleep(0.5)
    d.save_screenshot(os.path.join(out, "dashboard.png"))
    d.find_element(By.CSS_SELECTOR, "#start summary").click()
    config["max_steps"] = 200
    area = d.find_element(By.ID, "config")
    area.clear()
    area.send_keys(json.dumps(config))
    d.find_element(By.ID, "start-job").click()
    wait(d, "the long job is listed as running", lambda: d.find_elements(By.CSS_SELECTOR, "button.stop-job"), 60)
    stop_button = lambda: d.find_element(By.CSS_SELECTOR, "button.stop-job")
    job = retry(lambda: stop_button().find_element(By.XPATH, "./../..").get_attribute("data-job"))
    retry(lambda: stop_button().click())
    status = lambda: json.load(urllib.request.urlopen(f"{srv.base}/v1/train/jobs/{job}"))["status"]
    wait(d, "the stopped job ends", lambda: status() == "stopped", 300)
    log(f"3. job {job} stopped from the page")
    d.quit()


def error_checks(with_key, without_feedback):
    d = browser()
    open_chat(d, with_key.base, 8, key="wrong-key")
    rid = ask(d, "Hi")
    retry(lambda: answer(d, rid).find_element(By.CSS_SELECTOR, "button.rate.up").click())
    wait(d, "a bad admin key shows a message", lambda: "401" in notice(d), 30)
    log(f"4. bad admin key: {notice(d)!r}")
    # A stopped answer offers no rating (the server never kept it, a rating would be a 404),
    # says "stopped" once, and the next answer clears the earlier error.
    set_field(d, "max_tokens", 400)
    d.find_element(By.ID, "input").send_keys("Tell me a long story about the sea.")
    d.find_element(By.ID, "send").click()
    last = lambda: d.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]
    wait(d, "the long answer streams", lambda: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant")) == 2
         and last().find_element(By.CSS_SELECTOR, ".markdown").text.strip())
    assert not notice(d), f"the earlier error is still shown: {notice(d)!r}"
    d.find_element(By.ID, "stop").click()
    wait(d, "the answer stops", lambda: not d.find_element(By.ID, "stop").is_displayed())
    assert not retry(lambda: last().find_elements(By.CSS_SELECTOR, "button.rate")), "a stopped answer offers rating"
    labels = retry(lambda: [e.text for e in last().find_elements(By.CSS_SELECTOR, ".finish, .meta .error")])
    assert labels == ["stopped"], labels
    log("4. a stopped answer: no rating buttons, one 'stopped' label, the earlier error cleared")
    open_chat(d, without_feedback.base, 8)
    wait(d, "feedback off is stated", lambda: "feedback learning is off" in d.find_element(By.ID, "status").text, 30)
    rid = ask(d, "Hi")
    enabled = retry(lambda: answer(d, rid).find_element(By.CSS_SELECTOR, "button.rate.up").is_enabled())
    assert not enabled, "rating enabled with feedback off"
    log(f"4. feedback off: {d.find_element(By.ID, 'status').text!r}, rating buttons disabled")
    d.quit()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rlserve", default=os.path.join(ROOT, "target", "debug", "rlserve"))
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "browser", "screenshots"))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    servers = []
    try:
        main_srv = Server(a.rlserve, 8451, "--learn-from-feedback", "--feedback-batch-size", "3")
        servers.append(main_srv)
        chat_checks(main_srv, a.out)
        dashboard_checks(main_srv, a.out)
        keyed = Server(a.rlserve, 8452, "--learn-from-feedback", "--admin-key", "the-right-key")
        servers.append(keyed)
        off = Server(a.rlserve, 8453)
        servers.append(off)
        error_checks(keyed, off)
    finally:
        for s in servers:
            s.stop()
    log(f"all browser checks passed; screenshots in {a.out}")


if __name__ == "__main__":
    main()
