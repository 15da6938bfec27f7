// Which characters of a chunk belong to which logprob entry.
//
// The server decides which entries ride with which chunk (docs/alignment.md):
// a chunk carries, per channel, the entries of exactly the tokens whose first
// character of that channel is in it, plus markup tokens (no visible text:
// <think>, a tool call's envelope, EOS, a fragment of a character) that ride
// the next chunk of their channel. Within one chunk the page still has to cut
// the text among those entries. It does so from each token's exact bytes,
// decoded per channel with a streaming UTF-8 decoder, so that a character
// split over two tokens belongs to the token that completes it, as the
// server's detokenizer rules. A token whose text is partly dropped (the "}"
// of "}}\n" that closes the arguments, the rest being envelope) gets the part
// that is there; a token with none of its text there is markup.

/**
 * @typedef {{token: string, logprob: number, bytes: number[] | null, top_logprobs?: object[]}} Entry
 * @typedef {{kind: "token", entry: Entry, text: string, start: number}
 *   | {kind: "markup", entry: Entry, start: number}
 *   | {kind: "text", text: string, start: number}} Item
 */

function commonPrefix(a, b) {
  let n = 0;
  while (n < a.length && n < b.length && a[n] === b[n]) n += 1;
  return n;
}

/** The text of a token as it appears at `pos`: the whole piece, or the piece
 * without the whitespace a parser dropped in front of it. */
function fullMatch(text, pos, piece) {
  if (piece && text.startsWith(piece, pos)) return piece;
  const trimmed = piece.trimStart();
  if (trimmed && trimmed !== piece && text.startsWith(trimmed, pos)) return trimmed;
  return null;
}

/** Splits one channel's chunks among their entries, keeping the decoder state
 * between chunks. */
export class ChannelAligner {
  #decoder = new TextDecoder("utf-8");

  #piece(entry) {
    if (!Array.isArray(entry.bytes)) return entry.token;
    return this.#decoder.decode(Uint8Array.from(entry.bytes), { stream: true });
  }

  /** @param {string} text @param {Entry[]} entries @returns {Item[]} */
  align(text, entries) {
    const pieces = entries.map((entry) => this.#piece(entry));
    const items = [];
    let pos = 0;
    const take = (entry, length) => {
      items.push({ kind: "token", entry, text: text.slice(pos, pos + length), start: pos });
      pos += length;
    };
    entries.forEach((entry, i) => {
      const piece = pieces[i];
      const whole = fullMatch(text, pos, piece);
      if (whole !== null) return take(entry, whole.length);
      // A later token's text starts here: this one is markup riding along.
      if (pieces.slice(i + 1).some((later) => fullMatch(text, pos, later) !== null)) {
        return items.push({ kind: "markup", entry, start: pos });
      }
      const partial = commonPrefix(piece, text.slice(pos));
      if (partial > 0) return take(entry, partial);
      // Text owned by a token of another channel (one token can straddle a
      // </think>) stands before this one's: show it unmarked.
      const found = piece ? text.indexOf(piece, pos) : -1;
      if (found > pos) {
        items.push({ kind: "text", text: text.slice(pos, found), start: pos });
        pos = found;
        return take(entry, piece.length);
      }
      return items.push({ kind: "markup", entry, start: pos });
    });
    if (pos < text.length) items.push({ kind: "text", text: text.slice(pos), start: pos });
    return items;
  }
}

/** Items without entries: the chunk's text, when logprobs were not asked for. */
export function plainItems(text) {
  return text ? [{ kind: "text", text, start: 0 }] : [];
}

/** Cuts items of the concatenated `texts` back into one list per text (the
 * arguments of several tool calls in one chunk). Markup at a boundary goes
 * with the text that starts there: it is the envelope in front of that call. */
export function splitItems(items, texts) {
  const parts = texts.map(() => []);
  const ends = [];
  let offset = 0;
  for (const text of texts) ends.push((offset += text.length));
  const last = texts.length - 1;
  let segment = 0;
  for (const item of items) {
    let { start } = item;
    while (segment < last && start >= ends[segment]) segment += 1;
    if (item.kind !== "text") {
      parts[segment].push(item);
      continue;
    }
    let { text } = item;
    while (segment < last && start + text.length > ends[segment]) {
      const cut = ends[segment] - start;
      parts[segment].push({ ...item, text: text.slice(0, cut), start });
      text = text.slice(cut);
      start = ends[segment];
      segment += 1;
    }
    parts[segment].push({ ...item, text, start });
  }
  return parts;
}
