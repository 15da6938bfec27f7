// The settings panel: reading it into a chat completions request. Numbers are
// passed as typed (the server checks their ranges and its error is shown);
// the JSON fields are checked here, before anything is sent.

export const TOOLS_EXAMPLE = [
  {
    type: "function",
    function: {
      name: "get_weather",
      description: "The current weather in a city",
      parameters: {
        type: "object",
        properties: { city: { type: "string", description: "the city's name" } },
        required: ["city"],
      },
    },
  },
];

const NAME = /^[A-Za-z0-9_.-]{1,64}$/;

function isObject(value) {
  return typeof value === "object" && value !== null && !Array.isArray(value);
}

function parseJson(text) {
  try {
    return { value: JSON.parse(text) };
  } catch (error) {
    return { error: `not valid JSON: ${error.message}` };
  }
}

/** The problem with one tool, or null. */
function toolProblem(tool, at) {
  if (!isObject(tool)) return `${at} must be an object`;
  if (tool.type !== "function") return `${at}.type must be "function"`;
  const fn = tool.function;
  if (!isObject(fn)) return `${at}.function must be an object`;
  if (typeof fn.name !== "string" || !NAME.test(fn.name)) {
    return `${at}.function.name must be 1–64 letters, digits, "_", "." or "-"`;
  }
  if ("description" in fn && typeof fn.description !== "string") {
    return `${at}.function.description must be a string`;
  }
  if ("parameters" in fn && !isObject(fn.parameters)) {
    return `${at}.function.parameters must be a JSON Schema object`;
  }
  return null;
}

/** `{tools}` (null when the editor is empty) or `{error}`. */
export function parseTools(text) {
  if (!text.trim()) return { tools: null };
  const { value, error } = parseJson(text);
  if (error) return { error };
  if (!Array.isArray(value)) return { error: "tools must be a JSON array" };
  const names = new Set();
  for (const [i, tool] of value.entries()) {
    const problem = toolProblem(tool, `tools[${i}]`);
    if (problem) return { error: problem };
    if (names.has(tool.function.name)) return { error: `tools[${i}]: the name "${tool.function.name}" is used twice` };
    names.add(tool.function.name);
  }
  return { tools: value.length ? value : null };
}

/** `{extra}` (an object, maybe empty) or `{error}`. */
export function parseExtra(text) {
  if (!text.trim()) return { extra: {} };
  const { value, error } = parseJson(text);
  if (error) return { error };
  if (!isObject(value)) return { error: "extra fields must be a JSON object" };
  return { extra: value };
}

/** Stop strings: one per line, or a JSON array (for strings with newlines). */
export function parseStops(text) {
  const trimmed = text.trim();
  if (!trimmed) return { stop: null };
  if (trimmed.startsWith("[")) {
    const { value, error } = parseJson(trimmed);
    if (error) return { error };
    if (!Array.isArray(value) || !value.every((s) => typeof s === "string" && s)) {
      return { error: "stop strings must be a JSON array of non-empty strings" };
    }
    return { stop: value };
  }
  return { stop: text.split(/\r?\n/).filter((line) => line !== "") };
}

function numberOf(input) {
  return input.value.trim() === "" ? undefined : Number(input.value);
}

/**
 * The request body for `messages`, or the problems that keep it from being
 * sent, each with the id of the field to fix.
 * @returns {{body?: object, problems: {field: string, message: string}[]}}
 */
export function requestBody(doc, model, messages) {
  const value = (id) => doc.getElementById(id);
  const problems = [];
  const tools = parseTools(value("tools").value);
  if (tools.error) problems.push({ field: "tools", message: tools.error });
  const extra = parseExtra(value("extra").value);
  if (extra.error) problems.push({ field: "extra", message: extra.error });
  const stops = parseStops(value("stop-strings").value);
  if (stops.error) problems.push({ field: "stop-strings", message: stops.error });
  if (!model) problems.push({ field: "model", message: "no model: reload the model list" });
  if (problems.length) return { problems };

  const body = {
    model,
    messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: numberOf(value("temperature")),
    top_p: numberOf(value("top-p")),
    top_k: numberOf(value("top-k")),
    max_tokens: numberOf(value("max-tokens")),
    seed: numberOf(value("seed")),
    stop: stops.stop ?? undefined,
  };
  if (value("logprobs").checked) {
    body.logprobs = true;
    body.top_logprobs = numberOf(value("top-logprobs")) ?? 0;
  }
  const thinking = value("thinking").value;
  if (thinking) body.chat_template_kwargs = { enable_thinking: thinking === "true" };
  if (tools.tools) {
    body.tools = tools.tools;
    body.tool_choice = value("tool-choice").value;
  }
  for (const [key, field] of Object.entries(extra.extra)) {
    // chat_template_kwargs from both places are merged; anything else in
    // the extra fields wins over the panel.
    body[key] = key === "chat_template_kwargs" && isObject(field) ? { ...body[key], ...field } : field;
  }
  return { body: JSON.parse(JSON.stringify(body)), problems };
}
