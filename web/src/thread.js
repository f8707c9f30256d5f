// A conversation as a tree of messages: editing a message or regenerating a reply adds a sibling
// instead of overwriting, so earlier versions stay one click away. The conversation shown is the
// path from a root to the current leaf.
//
// A message is a plain object (stored as is in IndexedDB and in exported files) with id, role,
// content and parent (an id, or null for a first message). Children are derived from the parents,
// in the order the messages were added.
export class Thread {
  constructor(nodes = [], leaf = null) {
    this.nodes = new Map();
    for (const n of nodes) this.nodes.set(n.id, n);
    this.leaf = leaf && this.nodes.has(leaf) ? leaf : null;
    if (!this.leaf && nodes.length) this.leaf = this.#deepest(nodes[0].id);
  }

  // From a stored record, checking what an imported file could get wrong.
  static fromRecord(record, where = "conversation") {
    if (!record) return new Thread();
    const nodes = record.nodes;
    if (!Array.isArray(nodes)) throw new Error(`${where}: "nodes" must be an array of messages`);
    const ids = new Set();
    nodes.forEach((m, i) => {
      if (!m || typeof m.id !== "string" || !m.id) throw new Error(`${where}, message ${i}: no id`);
      if (ids.has(m.id)) throw new Error(`${where}, message ${i}: the id ${m.id} repeats`);
      ids.add(m.id);
      if (!["user", "assistant", "error"].includes(m.role))
        throw new Error(`${where}, message ${i}: role must be user, assistant or error`);
      if (typeof m.content !== "string") throw new Error(`${where}, message ${i}: content must be text`);
    });
    nodes.forEach((m, i) => {
      if (m.parent != null && !ids.has(m.parent))
        throw new Error(`${where}, message ${i}: its parent ${m.parent} is not in the conversation`);
    });
    // A parent chain that loops would never reach a root.
    for (const m of nodes) {
      const seen = new Set();
      for (let p = m; p && p.parent != null; p = nodes.find((n) => n.id === p.parent)) {
        if (seen.has(p.id)) throw new Error(`${where}: the messages' parents form a loop`);
        seen.add(p.id);
      }
    }
    return new Thread(nodes, typeof record.leaf === "string" ? record.leaf : null);
  }

  toRecord() {
    return { nodes: [...this.nodes.values()], leaf: this.leaf };
  }

  get size() {
    return this.nodes.size;
  }

  get(id) {
    return this.nodes.get(id);
  }

  children(id) {
    const out = [];
    for (const n of this.nodes.values()) if ((n.parent ?? null) === id) out.push(n);
    return out;
  }

  siblings(message) {
    return this.children(message.parent ?? null);
  }

  // Root to leaf.
  path() {
    const out = [];
    for (let m = this.nodes.get(this.leaf); m; m = this.nodes.get(m.parent)) out.unshift(m);
    return out;
  }

  // Adds a message under parent (null: a new first message) and makes it the leaf.
  add(message, parent) {
    message.parent = parent ?? null;
    this.nodes.set(message.id, message);
    this.leaf = message.id;
    return message;
  }

  // Removes a message and everything under it; the leaf moves up to its parent if it was there.
  remove(id) {
    const doomed = [id];
    for (let i = 0; i < doomed.length; i++)
      for (const c of this.children(doomed[i])) doomed.push(c.id);
    const leafGone = doomed.includes(this.leaf);
    const parent = this.nodes.get(id)?.parent ?? null;
    for (const d of doomed) this.nodes.delete(d);
    if (leafGone) this.leaf = parent;
  }

  // Shows the branch through message id, down its most recent children.
  select(id) {
    if (this.nodes.has(id)) this.leaf = this.#deepest(id);
  }

  #deepest(id) {
    for (;;) {
      const kids = this.children(id);
      if (!kids.length) return id;
      id = kids[kids.length - 1].id;
    }
  }
}
