// One assistant turn as it streams: reasoning (a collapsible section) above
// the content, tool calls as cards whose arguments fill in, and the readout
// (time to first token, tokens per second, usage). Each channel keeps its own
// aligner, so the entries that ride with a chunk are cut among exactly the
// text of that channel in that chunk.

import { ChannelAligner, plainItems, splitItems } from "./align.js";
import { el } from "./dom.js";
import { appendItems } from "./tokens.js";

function run(channel, label) {
  return el("div", { class: `run ${channel}`, role: "group", "aria-label": label });
}

export class AssistantTurn {
  #started;
  #firstAt = null;
  #lastAt = null;
  #aligners = { reasoning: new ChannelAligner(), content: new ChannelAligner(), tool: new ChannelAligner() };
  #reasoning = null;
  #reasoningText = "";
  #contentText = "";
  #calls = [];
  #usage = null;
  #finish = null;
  #matchedStop = null;
  #entries = 0;
  #shown = { reasoning: 0, content: 0, tool: 0 };
  #markup = 0;

  constructor(startedAt, onEvent) {
    this.#started = startedAt;
    this.onEvent = onEvent;
    this.content = run("content", "Answer tokens");
    this.callList = el("div", { class: "calls" });
    this.stats = el("dl", { class: "stats" });
    this.note = el("p", { class: "turn-note", hidden: true });
    this.node = el(
      "li",
      { class: "msg assistant" },
      el("h3", { class: "role" }, "Assistant"),
      this.content,
      this.callList,
      this.note,
      this.stats,
    );
  }

  get hasOutput() {
    return Boolean(this.#reasoningText || this.#contentText || this.#calls.length);
  }

  get calls() {
    return this.#calls;
  }

  /** Applies one `chat.completion.chunk` (only choice 0 is shown). */
  apply(chunk, now) {
    if (chunk.usage) this.#usage = chunk.usage;
    const choice = (chunk.choices || []).find((c) => c.index === 0);
    if (!choice) return this.#render();
    const delta = choice.delta || {};
    const logprobs = choice.logprobs || null;
    const reasoning = delta.reasoning_content ?? delta.reasoning ?? "";
    const content = delta.content ?? "";
    const calls = delta.tool_calls || [];
    if (reasoning || content || calls.length) {
      this.#firstAt ??= now;
      this.#lastAt = now;
    }
    this.#channel("reasoning", reasoning, logprobs?.reasoning_content, () => this.#reasoningRun());
    this.#channel("content", content, logprobs?.content, () => this.content);
    this.#toolCalls(calls, logprobs?.tool_calls);
    this.#reasoningText += reasoning;
    this.#contentText += content;
    if (choice.finish_reason) {
      this.#finish = choice.finish_reason;
      this.#matchedStop = choice.matched_stop ?? null;
    }
    this.#render();
  }

  #items(channel, text, entries) {
    if (!entries) return plainItems(text);
    this.#entries += entries.length;
    return this.#aligners[channel].align(text, entries);
  }

  #count(channel, items) {
    for (const item of items) {
      if (item.kind === "token") this.#shown[channel] += 1;
      else if (item.kind === "markup") this.#markup += 1;
    }
  }

  #channel(channel, text, entries, target) {
    if (!text && !entries?.length) return;
    if (channel === "reasoning" && text && !this.#reasoning) this.onEvent("Reasoning…");
    if (channel === "content" && text && !this.#contentText) this.onEvent("Writing the answer…");
    const items = this.#items(channel, text, entries);
    this.#count(channel, items);
    appendItems(target(), items, channel);
  }

  #reasoningRun() {
    if (!this.#reasoning) {
      this.#reasoning = run("reasoning", "Reasoning tokens");
      const section = el(
        "details",
        { class: "reasoning", open: true },
        el("summary", {}, "Reasoning"),
        this.#reasoning,
      );
      this.content.before(section);
    }
    return this.#reasoning;
  }

  #card(delta) {
    let call = this.#calls.find((c) => c.index === delta.index);
    if (!call) {
      const name = delta.function?.name ?? "";
      call = { index: delta.index, id: delta.id ?? "", name, arguments: "" };
      call.args = run("tool", `Arguments of ${name}`);
      call.args.classList.add("args");
      call.card = el(
        "article",
        { class: "tool-call", "aria-label": `Tool call ${name}` },
        el("p", { class: "tool-head" }, el("span", { class: "tool-name" }, name), " ", el("code", { class: "tool-id" }, call.id)),
        call.args,
      );
      this.#calls.push(call);
      this.callList.append(call.card);
      this.onEvent(`Calling ${name}…`);
    }
    return call;
  }

  #toolCalls(deltas, entries) {
    const calls = deltas.map((delta) => this.#card(delta));
    const texts = deltas.map((delta) => delta.function?.arguments ?? "");
    texts.forEach((text, i) => (calls[i].arguments += text));
    if (!texts.join("") && !entries?.length) return;
    const items = this.#items("tool", texts.join(""), entries);
    this.#count("tool", items);
    if (!calls.length) {
      // Markup of the calls (a closing tag, EOS) riding the final chunk.
      const last = this.#calls.at(-1);
      appendItems(last ? last.args : this.content, items, "tool call");
      return;
    }
    splitItems(items, texts).forEach((part, i) => appendItems(calls[i].args, part, "tool call"));
  }

  /** Ends the turn: "done", "stopped" or an error message. */
  end(how) {
    if (how !== "done") {
      this.note.hidden = false;
      this.note.textContent = how === "stopped" ? "Stopped." : how;
      this.note.classList.toggle("error", how !== "stopped");
    }
    for (const call of this.#calls) {
      let valid = true;
      try {
        JSON.parse(call.arguments);
      } catch {
        valid = false;
      }
      call.card.append(el("p", { class: `tool-json ${valid ? "" : "invalid"}` }, valid ? "Arguments: valid JSON" : "Arguments: not valid JSON"));
    }
  }

  /** The assistant message to send back in the next request. */
  message() {
    const message = { role: "assistant", content: this.#contentText || null };
    if (this.#reasoningText) message.reasoning_content = this.#reasoningText;
    if (this.#calls.length) {
      message.tool_calls = this.#calls.map((call) => ({
        id: call.id,
        type: "function",
        function: { name: call.name, arguments: call.arguments },
      }));
    }
    return message;
  }

  summary() {
    const tokens = this.#usage?.completion_tokens;
    return `Done: ${tokens ?? "?"} tokens, finish reason ${this.#finish ?? "none"}.`;
  }

  #render() {
    const rows = [];
    const add = (key, label, value) => {
      if (value === null || value === undefined) return;
      rows.push(el("div", {}, el("dt", {}, label), el("dd", { "data-stat": key }, String(value))));
    };
    if (this.#firstAt !== null) add("ttft_ms", "TTFT", `${Math.round(this.#firstAt - this.#started)} ms`);
    const usage = this.#usage;
    const generated = usage?.completion_tokens ?? (this.#entries || null);
    const seconds = (this.#lastAt - this.#firstAt) / 1000;
    if (generated > 1 && seconds > 0) add("tokens_per_second", "tokens/s", ((generated - 1) / seconds).toFixed(1));
    add("prompt_tokens", "prompt", usage?.prompt_tokens);
    add("completion_tokens", "completion", usage?.completion_tokens);
    add("reasoning_tokens", "reasoning", usage?.completion_tokens_details?.reasoning_tokens);
    const shown = this.#shown.reasoning + this.#shown.content + this.#shown.tool;
    if (this.#entries) {
      add("shown_tokens", "shown", `${shown} (${this.#shown.reasoning} reasoning, ${this.#shown.content} content, ${this.#shown.tool} tool-call)`);
      add("markup_tokens", "markup", this.#markup);
    }
    add("finish_reason", "finish", this.#finish);
    add("matched_stop", "matched stop", this.#matchedStop === null ? null : JSON.stringify(this.#matchedStop));
    this.stats.replaceChildren(...rows);
  }
}
