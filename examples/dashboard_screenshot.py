"""Put a running `tidal serve` under a steady mixed load and take a screenshot of its /dashboard in
headless Chromium (how docs/dashboard.png is made).

    tidal serve --max-num-seqs 4 --max-model-len 2048 --kv-cache-memory-bytes 67108864 --api-key secret &
    python examples/dashboard_screenshot.py --base-url http://127.0.0.1:8000 --api-key secret \\
        --seconds 90 --out docs/dashboard.png

The load: `--concurrency` clients, each sending completions one after another; half the prompts
start with a shared system text (prefix-cache hits), the rest are random lengths of fresh text.
Needs selenium, and Debian's chromium and chromium-driver.
"""
from __future__ import annotations

import argparse
import random
import shutil
import threading
import time

import httpx


def _client(base: str, api_key: str | None, model: str, stop: threading.Event, seed: int) -> None:
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    shared = "You are a helpful assistant that answers questions about the sea, ships and harbours. " * 6
    while not stop.is_set():
        words = " ".join(rng.choice(["wave", "tide", "salt", "hull", "mast", "gull", "reef"])
                         for _ in range(rng.randint(10, 300)))
        prompt = (shared if rng.random() < 0.5 else "") + f"Question {rng.randint(0, 10**6)}: {words}"
        httpx.post(f"{base}/v1/completions", headers=headers, timeout=600,
                   json={"model": model, "prompt": prompt, "max_tokens": rng.randint(16, 160), "ignore_eos": True})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--seconds", type=float, default=90.0, help="load before the screenshot")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--out", default="dashboard.png")
    args = parser.parse_args()
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = httpx.get(f"{args.base_url}/v1/models", headers=headers).json()["data"][0]["id"]
    stop = threading.Event()
    clients = [threading.Thread(target=_client, args=(args.base_url, args.api_key, model, stop, i), daemon=True)
               for i in range(args.concurrency)]
    for c in clients:
        c.start()
    options = Options()
    options.binary_location = shutil.which("chromium") or shutil.which("chromium-browser")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,1250"):
        options.add_argument(arg)
    browser = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    try:
        browser.get(f"{args.base_url}/dashboard")
        wait = WebDriverWait(browser, 60)
        if args.api_key:
            wait.until(lambda d: d.find_element(By.ID, "api-key").is_displayed())
            browser.find_element(By.ID, "api-key").send_keys(args.api_key)
            browser.find_element(By.ID, "login-button").click()
        wait.until(lambda d: d.find_element(By.ID, "model").text == model)
        time.sleep(args.seconds)  # let the time series fill
        browser.save_screenshot(args.out)
        print(f"saved {args.out}")
    finally:
        stop.set()
        browser.quit()


if __name__ == "__main__":
    main()
