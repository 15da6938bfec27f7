// Server-sent events, fed piece by piece as the response body arrives: a
// sans-IO decoder (text in, the data of complete events out), then the loop
// that reads a fetch response through it.

/** Splits SSE text into events; `feed` returns the `data` of each event it completed. */
export class SseDecoder {
  #buffer = "";
  #data = [];

  feed(text) {
    this.#buffer += text;
    const events = [];
    // A line ends at \n, \r\n or \r; a trailing \r may still become \r\n.
    const lines = this.#buffer.split(/\r\n|\n|\r(?!$)/);
    this.#buffer = lines.pop();
    for (const line of lines) {
      if (line === "") {
        if (this.#data.length) events.push(this.#data.join("\n"));
        this.#data = [];
      } else if (line.startsWith("data:")) {
        this.#data.push(line.slice(line.startsWith("data: ") ? 6 : 5));
      }
      // Comments (": keepalive") and other fields carry nothing we use.
    }
    return events;
  }
}

/** The JSON payloads of a streamed response, until `data: [DONE]` or the end of the body. */
export async function* sseJson(response) {
  const reader = response.body.getReader();
  const text = new TextDecoder();
  const decoder = new SseDecoder();
  let ended = false;
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) {
        ended = true;
        return;
      }
      for (const data of decoder.feed(text.decode(value, { stream: true }))) {
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  } finally {
    // A reader that stops early closes the connection, so the server cancels.
    if (!ended) reader.cancel().catch(() => {});
  }
}
