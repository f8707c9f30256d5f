// Conversations kept in the browser's IndexedDB: one record per conversation in "conversations"
// (id, title, created, updated; small, listed at start) and its messages, attachments included,
// in "messages" under the same id as {id, thread: {nodes, leaf}} (thread.js; loaded when the
// conversation is opened or searched).
const DB_NAME = "gemstage-chat";
const DB_VERSION = 1;

function request(r) {
  return new Promise((resolve, reject) => {
    r.onsuccess = () => resolve(r.result);
    r.onerror = () => reject(r.error);
  });
}

export class ConversationStore {
  static async open() {
    const open = indexedDB.open(DB_NAME, DB_VERSION);
    open.onupgradeneeded = () => {
      const db = open.result;
      if (!db.objectStoreNames.contains("conversations"))
        db.createObjectStore("conversations", { keyPath: "id" });
      if (!db.objectStoreNames.contains("messages"))
        db.createObjectStore("messages", { keyPath: "id" });
    };
    return new ConversationStore(await request(open));
  }

  constructor(db) {
    this.db = db;
  }

  #transaction(mode, fn) {
    return new Promise((resolve, reject) => {
      const tx = this.db.transaction(["conversations", "messages"], mode);
      let result;
      tx.oncomplete = () => resolve(result);
      tx.onerror = () => reject(tx.error);
      tx.onabort = () => reject(tx.error || new Error("the browser aborted the storage write"));
      Promise.resolve(fn(tx.objectStore("conversations"), tx.objectStore("messages")))
        .then((r) => { result = r; }, reject);
    });
  }

  // Every conversation's header, newest first.
  async list() {
    const all = await this.#transaction("readonly", (c) => request(c.getAll()));
    return all.sort((a, b) => b.updated - a.updated);
  }

  async thread(id) {
    const record = await this.#transaction("readonly", (c, m) => request(m.get(id)));
    return record ? record.thread : null;
  }

  // Writes the header and the messages together, so a reload never sees one without the other.
  save(conversation, thread) {
    const { id, title, created, updated, titleEdited } = conversation;
    return this.#transaction("readwrite", (c, m) => {
      c.put({ id, title, created, updated, titleEdited: !!titleEdited });
      m.put({ id, thread });
    });
  }

  saveHeader(conversation) {
    const { id, title, created, updated, titleEdited } = conversation;
    return this.#transaction("readwrite", (c) => {
      c.put({ id, title, created, updated, titleEdited: !!titleEdited });
    });
  }

  remove(id) {
    return this.#transaction("readwrite", (c, m) => {
      c.delete(id);
      m.delete(id);
    });
  }
}
