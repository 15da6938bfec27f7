// The playground: a conversation with the server's own /v1/chat/completions
// over SSE. The API key lives in a variable of this module only (never in
// storage) and goes out as `Authorization: Bearer` on this page's requests.

import { el } from "./dom.js";
import { parseExtra, parseTools, requestBody, TOOLS_EXAMPLE } from "./settings.js";
import { sseJson } from "./sse.js";
import { Inspector, legendItems } from "./tokens.js";
import { AssistantTurn } from "./turn.js";

const $ = (id) => document.getElementById(id);

const state = {
  apiKey: "",
  history: [],
  controller: null,
  resultForms: [],
  // Bumped by "New conversation", so that a turn still streaming then is dropped.
  conversation: 0,
};

let inspector = null;

class ApiError extends Error {
  constructor(error, status) {
    const where = [error.type, error.param && `param ${error.param}`, error.code].filter(Boolean).join(", ");
    super(`${status ? `HTTP ${status}: ` : ""}${error.message ?? "error"}${where ? ` (${where})` : ""}`);
    this.status = status;
  }
}

async function errorOf(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    if (body && typeof body.error === "object") return new ApiError(body.error, response.status);
  } catch {
    // Not JSON: a proxy's page, say. Its text is shown as it is.
  }
  return new ApiError({ message: text.slice(0, 300) || response.statusText }, response.status);
}

function headers(json) {
  const all = json ? { "content-type": "application/json" } : {};
  if (state.apiKey) all.authorization = `Bearer ${state.apiKey}`;
  return all;
}

function announce(text) {
  $("status").textContent = text;
}

function showError(text) {
  const box = $("error");
  box.textContent = text;
  box.hidden = !text;
}

function setBusy(busy) {
  const lost = document.activeElement === (busy ? $("send") : $("stop"));
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("conversation").setAttribute("aria-busy", String(busy));
  // A button that gets disabled drops the keyboard focus: keep it useful.
  if (lost) (busy ? $("stop") : $("message")).focus();
}

// --- models -------------------------------------------------------------------

async function loadModels() {
  const select = $("model");
  try {
    const response = await fetch("/v1/models", { headers: headers(false) });
    if (!response.ok) throw await errorOf(response);
    const { data } = await response.json();
    const previous = select.value;
    select.replaceChildren(...data.map((model) => el("option", { value: model.id }, model.id)));
    if (data.some((model) => model.id === previous)) select.value = previous;
    showError("");
  } catch (error) {
    select.replaceChildren(el("option", { value: "" }, "(no model list)"));
    const hint = error.status === 401 ? " Type the server's API key above." : "";
    showError(`Could not list the models: ${error.message}${hint}`);
  }
}

// --- the conversation ---------------------------------------------------------

function messageItem(kind, title, text) {
  return el("li", { class: `msg ${kind}` }, el("h3", { class: "role" }, title), el("div", { class: "text" }, text));
}

function lastIsToolResult() {
  return state.history.at(-1)?.role === "tool";
}

/** The result forms of the latest turn's tool calls (one result per call). */
function setResultForms(disabled) {
  for (const form of state.resultForms) {
    if (!form.dataset.added) form.querySelector("fieldset").disabled = disabled;
  }
}

function resultForm(call) {
  const id = `result-${call.id || Math.random().toString(36).slice(2)}`;
  const input = el("textarea", { id, rows: 2, spellcheck: "false" });
  const form = el(
    "form",
    { class: "tool-result" },
    el(
      "fieldset",
      {},
      el("label", { for: id }, `Result of ${call.name}`),
      input,
      el("button", { type: "submit" }, "Add result"),
    ),
  );
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const message = { role: "tool", tool_call_id: call.id, content: input.value };
    state.history.push(message);
    $("conversation").append(messageItem("tool", `Result of ${call.name}`, input.value));
    form.dataset.added = "yes";
    form.querySelector("fieldset").disabled = true;
    announce(`Result of ${call.name} added. Send to continue.`);
    $("message").focus();
  });
  return form;
}

function withSystem(messages) {
  const system = $("system-prompt").value;
  return system.trim() ? [{ role: "system", content: system }, ...messages] : messages;
}

const CHECKED_FIELDS = ["model", "tools", "extra", "stop-strings"];

function clearProblems() {
  for (const id of CHECKED_FIELDS) {
    $(id).removeAttribute("aria-invalid");
    const note = $(`${id}-error`);
    if (note) note.textContent = "";
  }
}

function markProblems(problems) {
  for (const { field, message } of problems) {
    const input = $(field);
    input.setAttribute("aria-invalid", "true");
    const note = $(`${field}-error`);
    if (note) note.textContent = message;
  }
  showError(problems.map((p) => p.message).join("; "));
  $(problems[0].field).focus();
}

async function stream(turn, body) {
  const response = await fetch("/v1/chat/completions", {
    method: "POST",
    headers: headers(true),
    body: JSON.stringify(body),
    signal: state.controller.signal,
  });
  if (!response.ok) throw await errorOf(response);
  for await (const chunk of sseJson(response)) {
    // A failure after the stream started comes as one error event.
    if (chunk.error) throw new ApiError(chunk.error, 0);
    turn.apply(chunk, performance.now());
  }
}

/** Takes back a turn that produced nothing: its user message leaves the
 * history and goes back into the box, so nothing half-sent lingers. */
function undo(turn, user, userItem) {
  turn.node.remove();
  if (user) {
    state.history.pop();
    userItem.remove();
    $("message").value = user.content;
  }
  setResultForms(false);
}

async function send() {
  showError("");
  clearProblems();
  const text = $("message").value;
  const user = text.trim() ? { role: "user", content: text } : null;
  if (!user && !lastIsToolResult()) {
    showError("Type a message first.");
    $("message").focus();
    return;
  }
  const messages = withSystem([...state.history, ...(user ? [user] : [])]);
  const { body, problems } = requestBody(document, $("model").value, messages);
  if (problems.length) return markProblems(problems);

  const conversation = state.conversation;
  const userItem = user ? messageItem("user", "You", user.content) : null;
  if (user) {
    state.history.push(user);
    $("conversation").append(userItem);
    $("message").value = "";
  }
  // Results added while this turn streams would land after it in the history.
  setResultForms(true);
  const turn = new AssistantTurn(performance.now(), announce);
  $("conversation").append(turn.node);
  state.controller = new AbortController();
  setBusy(true);
  announce("Sending…");
  let outcome = "done";
  try {
    await stream(turn, body);
  } catch (error) {
    outcome = error.name === "AbortError" ? "stopped" : error.message;
  } finally {
    state.controller = null;
    setBusy(false);
  }
  if (conversation !== state.conversation) return; // cleared meanwhile
  if (!turn.hasOutput) {
    undo(turn, user, userItem);
    showError(outcome === "done" ? "The model generated nothing." : outcome === "stopped" ? "" : outcome);
    announce(outcome === "stopped" ? "Stopped before any output." : "Nothing was generated.");
    return;
  }
  turn.end(outcome);
  if (outcome !== "done" && outcome !== "stopped") showError(outcome);
  announce(outcome === "done" ? turn.summary() : outcome === "stopped" ? "Stopped." : "Failed.");
  state.history.push(turn.message());
  state.resultForms = turn.calls.map((call) => {
    const form = resultForm(call);
    call.card.append(form);
    return form;
  });
}

function clearConversation() {
  state.controller?.abort();
  state.conversation += 1;
  state.history = [];
  state.resultForms = [];
  inspector.hide();
  $("conversation").replaceChildren();
  showError("");
  announce("New conversation.");
}

// --- wiring ---------------------------------------------------------------------

function validateJsonField(id, parse) {
  const input = $(id);
  const { error } = parse(input.value);
  input.setAttribute("aria-invalid", String(Boolean(error)));
  $(`${id}-error`).textContent = error ?? "";
}

function start() {
  $("legend").append(...legendItems());
  inspector = new Inspector($("inspector"), $("conversation"));
  $("api-key").addEventListener("input", (event) => {
    state.apiKey = event.target.value.trim();
  });
  $("api-key").addEventListener("change", loadModels);
  $("connection").addEventListener("submit", (event) => {
    event.preventDefault();
    loadModels();
  });
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    send();
  });
  $("message").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => state.controller?.abort());
  $("clear").addEventListener("click", clearConversation);
  $("show-markup").addEventListener("change", (event) => {
    $("conversation").classList.toggle("show-markup", event.target.checked);
  });
  $("tools").addEventListener("input", () => validateJsonField("tools", parseTools));
  $("extra").addEventListener("input", () => validateJsonField("extra", parseExtra));
  $("tools-example").addEventListener("click", () => {
    $("tools").value = JSON.stringify(TOOLS_EXAMPLE, null, 2);
    validateJsonField("tools", parseTools);
  });
  loadModels();
}

start();
