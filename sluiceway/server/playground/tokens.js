// Token spans: each token of reasoning, content and tool-call arguments is a
// span coloured by its probability; hovering, tapping or focusing one shows
// the inspector (token, bytes, logprob, top alternatives). Keyboard: one tab
// stop per token run (a roving tabindex), arrow keys move between tokens.
// Everything the model wrote goes into the page through textContent only.

import { el } from "./dom.js";

/** Probability buckets of the heat-map, most likely first (class h0..h5). */
export const BUCKETS = [
  { min: 0.9, label: "≥ 90%" },
  { min: 0.7, label: "70–90%" },
  { min: 0.5, label: "50–70%" },
  { min: 0.3, label: "30–50%" },
  { min: 0.1, label: "10–30%" },
  { min: 0, label: "< 10%" },
];

/** The server reports a logprob of −∞ as this number. */
const NEG_INF = -9999;

const entries = new WeakMap();

export function bucketOf(logprob) {
  const p = Math.exp(logprob);
  return BUCKETS.findIndex((bucket) => p >= bucket.min);
}

export function formatLogprob(logprob) {
  if (logprob <= NEG_INF) return "-inf (reported as -9999)";
  if (logprob !== 0 && Math.abs(logprob) < 1e-3) return logprob.toExponential(4);
  return logprob.toFixed(4);
}

function formatProbability(logprob) {
  if (logprob <= NEG_INF) return "0%";
  const p = Math.exp(logprob) * 100;
  return p >= 99.995 || p < 0.01 ? `${p.toPrecision(3)}%` : `${p.toFixed(2)}%`;
}

function formatBytes(bytes) {
  if (!Array.isArray(bytes)) return "(not given)";
  return bytes.map((b) => b.toString(16).padStart(2, "0")).join(" ") || "(none)";
}

/** Appends aligned items (see align.js) to a token run. */
export function appendItems(run, items, channel) {
  for (const item of items) {
    if (item.kind === "text") {
      run.append(item.text);
      continue;
    }
    const span =
      item.kind === "token"
        ? el("span", { class: `tok h${bucketOf(item.entry.logprob)}` }, item.text)
        : el("span", { class: "markup" }, item.entry.token);
    span.tabIndex = run.querySelector("[tabindex='0']") ? -1 : 0;
    entries.set(span, { entry: item.entry, channel, markup: item.kind === "markup" });
    run.append(span);
  }
}

/** Spans a keyboard can reach in a run (markup only while it is shown). */
function reachable(run) {
  return [...run.querySelectorAll(".tok, .markup")].filter((span) => span.getClientRects().length);
}

function inspectorContent(info) {
  const { entry, channel, markup } = info;
  const alternatives = (entry.top_logprobs || []).map((alt) =>
    el(
      "tr",
      { class: alt.token === entry.token ? "chosen" : "" },
      el("td", {}, el("code", {}, JSON.stringify(alt.token))),
      el("td", { class: "num" }, formatLogprob(alt.logprob)),
      el("td", { class: "num" }, formatProbability(alt.logprob)),
    ),
  );
  return [
    el(
      "p",
      { class: "insp-head" },
      el("code", { class: "insp-token" }, JSON.stringify(entry.token)),
      el("span", { class: "insp-channel" }, markup ? `${channel} · markup` : channel),
    ),
    el(
      "dl",
      {},
      el("dt", {}, "logprob"),
      el("dd", { class: "insp-logprob" }, formatLogprob(entry.logprob)),
      el("dt", {}, "probability"),
      el("dd", { class: "insp-probability" }, formatProbability(entry.logprob)),
      el("dt", {}, "bytes"),
      el("dd", {}, el("code", { class: "insp-bytes" }, formatBytes(entry.bytes))),
    ),
    alternatives.length
      ? el(
          "table",
          { class: "insp-alternatives" },
          el("caption", {}, "Top alternatives"),
          el("thead", {}, el("tr", {}, el("th", {}, "token"), el("th", {}, "logprob"), el("th", {}, "p"))),
          el("tbody", {}, ...alternatives),
        )
      : el("p", { class: "note" }, "No alternatives asked for (top_logprobs 0)."),
  ];
}

/** The one inspector of the page, wired to every token run inside `root`. */
export class Inspector {
  #box;
  #shown = null;

  constructor(box, root) {
    this.#box = box;
    // Hovering shows a token where the inspector floats beside it; where it
    // docks over the bottom of the screen (phone width), a tap does.
    root.addEventListener("mouseover", (event) => {
      const span = event.target.closest?.(".tok, .markup");
      if (span && entries.has(span) && !this.#docked()) this.show(span);
    });
    root.addEventListener("mouseout", (event) => {
      const span = event.target.closest?.(".tok, .markup");
      if (this.#box.contains(event.relatedTarget)) return;
      if (span && span === this.#shown && document.activeElement !== span) this.hide();
    });
    root.addEventListener("focusin", (event) => {
      if (entries.has(event.target)) this.#focus(event.target);
    });
    root.addEventListener("focusout", (event) => {
      if (event.target === this.#shown) this.hide();
    });
    root.addEventListener("keydown", (event) => this.#key(event));
    window.addEventListener("resize", () => this.#shown && this.#place(this.#shown));
  }

  show(span) {
    const info = entries.get(span);
    this.#shown = span;
    this.#box.replaceChildren(...inspectorContent(info));
    this.#box.hidden = false;
    this.#place(span);
  }

  hide() {
    this.#shown?.removeAttribute("aria-describedby");
    this.#shown = null;
    this.#box.hidden = true;
  }

  #focus(span) {
    for (const other of span.parentElement.querySelectorAll("[tabindex='0']")) other.tabIndex = -1;
    span.tabIndex = 0;
    span.setAttribute("aria-describedby", this.#box.id);
    this.show(span);
  }

  #key(event) {
    const span = event.target;
    if (!entries.has(span)) return;
    if (event.key === "Escape") return this.hide();
    const spans = reachable(span.parentElement);
    const at = spans.indexOf(span);
    const moves = { ArrowRight: at + 1, ArrowLeft: at - 1, Home: 0, End: spans.length - 1 };
    if (!(event.key in moves)) return;
    event.preventDefault();
    spans[Math.max(0, Math.min(spans.length - 1, moves[event.key]))]?.focus();
  }

  #docked() {
    return getComputedStyle(this.#box).position === "fixed";
  }

  #place(span) {
    const box = this.#box;
    if (this.#docked()) return;
    const rect = span.getBoundingClientRect();
    const width = box.offsetWidth;
    const left = Math.max(8, Math.min(rect.left, document.documentElement.clientWidth - width - 8));
    const below = rect.bottom + 6;
    const top = below + box.offsetHeight > window.innerHeight && rect.top > box.offsetHeight + 6
      ? rect.top - box.offsetHeight - 6
      : below;
    box.style.left = `${left + window.scrollX}px`;
    box.style.top = `${top + window.scrollY}px`;
  }
}

/** The legend of the heat-map. */
export function legendItems() {
  return BUCKETS.map((bucket, i) => el("li", {}, el("span", { class: `swatch h${i}` }, bucket.label)));
}
