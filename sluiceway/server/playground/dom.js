// Building elements from nodes and text only: children are nodes or strings, and a
// string always becomes a text node, whatever it contains.

/** A new element with attributes (set with setAttribute; empty values skipped) and children. */
export function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (value !== "" && value !== null && value !== undefined && value !== false) {
      node.setAttribute(name, value === true ? "" : String(value));
    }
  }
  node.append(...children.filter((child) => child !== null && child !== undefined));
  return node;
}
