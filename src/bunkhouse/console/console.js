// bunkhouse's web console: the memory budget (each node's, with --ray), each model's
// state, the recent residency events (live from GET /admin/events), operator buttons and a
// chat box. Plain script, no build step, no outside resources. Keys are kept in this tab's
// sessionStorage only and sent in the Authorization header, never in a URL.
"use strict";

const $ = (sel) => document.querySelector(sel);
const COLORS = ["#3b82f6", "#10b981", "#f59e0b", "#8b5cf6", "#ef4444", "#14b8a6", "#ec4899",
                "#6366f1"];
const MIB = 1024 * 1024;
const GENERATES = ["chat", "completion"];  // model kinds the chat box can try
const state = { models: [], stats: null, lastSeq: null, colors: new Map() };

function keyFor(level) {
  const admin = sessionStorage.getItem("bunkhouse.admin") || "";
  const client = sessionStorage.getItem("bunkhouse.client") || "";
  return level === "admin" ? admin : (client || admin);
}

function headers(level, extra) {
  const h = Object.assign({}, extra || {});
  const key = keyFor(level);
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function errorText(resp) {
  try {
    const body = await resp.json();
    const err = body.error || body;
    return (err && (err.message || err.error)) || resp.statusText;
  } catch (e) {
    return resp.status + " " + resp.statusText;
  }
}

function mib(bytes) {
  return bytes == null ? "–" : Math.round(bytes / MIB) + " MiB";
}

function idle(model, now) {
  if (model.state !== "ready" || model.leases > 0 || !model.last_used) return "–";
  const s = Math.max(0, Math.round(now - model.last_used));
  return s < 120 ? s + " s" : Math.round(s / 60) + " min";
}

function colorOf(id) {
  if (!state.colors.has(id)) state.colors.set(id, COLORS[state.colors.size % COLORS.length]);
  return state.colors.get(id);
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const child of children) node.append(child);
  return node;
}

function readNote(text) {
  const note = $("#admin-note");
  if (text) {
    note.textContent = text;
    note.className = "note bad";
    note.dataset.read = "true";
  } else if (note.dataset.read) {  // the models could not be read before; they can now
    note.textContent = "";
    note.className = "note";
    delete note.dataset.read;
  }
}

async function refresh() {
  let resp;
  try {
    resp = await fetch("/stats", { headers: headers("client") });
  } catch (e) {
    readNote("Cannot reach the server (" + e.message + "); retrying with the event stream.");
    return;
  }
  if (!resp.ok) {
    const why = (await errorText(resp)).replace(/\.?$/, ".");
    readNote("Cannot read the models: " + why +
             (resp.status === 401 || resp.status === 403 ? " Enter a client key above." : ""));
    return;
  }
  readNote("");
  state.stats = await resp.json();
  state.models = state.stats.models;
  showRecent(state.stats.events || []);
  render();
}

// The events the server still holds, shown once when the page opens (or first reads the
// server, once given its key); the stream then resumes after the last of them.
function showRecent(events) {
  if (state.lastSeq != null || $("#events").children.length) return;
  for (const event of events) {
    if (event.kind !== "load_progress") showEvent(event);
    if (event.seq != null) state.lastSeq = event.seq;
  }
}

function render() {
  const stats = state.stats;
  if (!stats) return;
  const now = Date.now() / 1000;
  const budget = stats.budget_bytes;
  const nodes = stats.nodes || [];
  // a cluster's nodes (--ray): a bar each, its models in it; one machine: one bar
  const clustered = nodes.some((n) => n.id !== "local");
  $("#memory-figures").textContent = mib(stats.used_bytes) + " used of " + mib(budget) +
    (clustered ? " on " + nodes.length + " node" + (nodes.length === 1 ? "" : "s") : "") +
    " (peak " + mib(stats.peak_used_bytes) + ")" +
    (stats.spare_worker && !clustered ? ", " + mib(stats.spare_worker.bytes) +
     " for a spare worker" : "");
  const bar = $("#bar");
  bar.replaceChildren();
  bar.hidden = clustered;
  const nodeBars = new Map();
  const nodeList = $("#nodes");
  nodeList.replaceChildren();
  for (const n of clustered ? nodes : []) {
    const row = el("div", { class: "node-bar", role: "img", "data-node": n.id,
                            "aria-label": "node " + n.id + ": its budget by model" });
    nodeBars.set(n.id, [row, n.budget_bytes]);
    nodeList.append(el("div", { class: "node", "data-node": n.id },
      el("div", { class: "node-label", title: n.id },
         "node " + n.id.slice(0, 12) + ": " + mib(n.used_bytes) + " used of " +
         mib(n.budget_bytes) + (n.models.length ? " (" + n.models.join(", ") + ")" : "") +
         (n.spare ? ", " + mib(n.spare.bytes) + " for a spare worker" : "")),
      row));
  }
  const legend = $("#legend");
  legend.replaceChildren();
  for (const m of state.models) {
    if (!["loading", "ready", "draining"].includes(m.state)) continue;
    const [where, room] = clustered ? (nodeBars.get(m.node) || [null, 0]) : [bar, budget];
    if (!where) continue;
    const held = Math.max(m.estimated_bytes || 0, m.measured_bytes || 0);
    const seg = el("div", { class: "seg", "data-model": m.id,
                            title: m.id + ": measured " + mib(m.measured_bytes) +
                                   ", estimated " + mib(m.estimated_bytes) });
    seg.style.width = (100 * held / room) + "%";
    const est = el("div", { class: "estimate" });
    est.style.background = colorOf(m.id);
    const measured = el("div", { class: "measured" });
    measured.style.background = colorOf(m.id);
    measured.style.width = held ? (100 * (m.measured_bytes || 0) / held) + "%" : "0";
    seg.append(est, measured);
    where.append(seg);
    const swatch = el("span", { class: "swatch" });
    swatch.style.background = colorOf(m.id);
    legend.append(el("span", {}, swatch, m.id + " " + m.state));
  }
  legend.append(el("span", {}, "solid: measured; faint: estimated"));

  const tbody = $("#models tbody");
  tbody.replaceChildren();
  for (const m of state.models) {
    const actions = el("td", { class: "actions" });
    for (const action of ["load", "unload", m.pinned ? "unpin" : "pin"]) {
      actions.append(el("button", { type: "button", "data-action": action,
                                    "data-model": m.id,
                                    onclick: () => act(m.id, action) }, action));
    }
    tbody.append(el("tr", { "data-model": m.id },
      el("td", {}, m.id + (m.default ? " (default)" : "")),
      el("td", {}, el("span", { class: "state " + m.state, "data-state": m.state }, m.state)),
      el("td", {}, m.pinned ? "yes" : ""),
      el("td", {}, String(m.leases)),
      el("td", { title: "running in its slots / queued for a slot / waiting for its " +
                        "load or for memory" }, m.running + " / " + m.queued + " / " +
         (m.waiting || 0)),
      el("td", {}, mib(m.measured_bytes) + " / " + mib(m.estimated_bytes)),
      el("td", {}, idle(m, now)),
      el("td", { class: "error" }, m.last_error || ""),
      actions));
  }

  const select = $("#chat-model");
  const chosen = select.value;
  // what generates text: chat and base models, whether or not they also embed
  const usable = state.models.filter((m) => GENERATES.includes(m.kind));
  const listed = Array.from(select.options, (o) => o.value).join("\n");
  if (listed !== usable.map((m) => m.id).join("\n")) {
    select.replaceChildren(...usable.map((m) => el("option", { value: m.id }, m.id)));
    const fallback = usable.find((m) => m.default) || usable[0];
    select.value = chosen || (fallback ? fallback.id : "");
  }
}

async function act(modelId, action) {
  const note = $("#admin-note");
  if (!keyFor("admin")) {
    note.textContent = "The buttons need the admin key: enter it above (the server takes " +
      "it from --admin-key; without one, admin is off).";
    note.className = "note bad";
    return;
  }
  note.textContent = action + " " + modelId + "…";
  note.className = "note";
  let resp;
  try {
    resp = await fetch("/v1/models/" + encodeURIComponent(modelId) + "/" + action,
                       { method: "POST", headers: headers("admin") });
  } catch (e) {
    note.textContent = action + " " + modelId + ": cannot reach the server (" + e.message +
      ")";
    note.className = "note bad";
    return;
  }
  if (resp.ok) {
    // what changed, from the answer: 202 draining; a model object's "changed" false: it
    // was so already (an unload of a model that holds nothing, a second pin)
    const body = resp.status === 200 ? await resp.json().catch(() => ({})) : {};
    note.textContent = action + " " + modelId + ": " + (
      resp.status === 202 ? "draining: freed when its running requests end" :
      body.changed === false ? "nothing changed (it was so already)" : "done");
  } else {
    note.textContent = action + " " + modelId + ": " + await errorText(resp);
    note.className = "note bad";
  }
  refresh();
}

// Server-Sent Events over fetch (EventSource cannot send a key): calls onMessage with each
// message's {id, event, data} until the stream ends.
async function readEvents(resp, onMessage) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let message = { data: [] };
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let newline;
    while ((newline = buffer.search(/\r?\n/)) >= 0) {
      const line = buffer.slice(0, newline);
      buffer = buffer.slice(newline + (buffer[newline] === "\r" ? 2 : 1));
      if (line === "") {
        if (message.data.length) onMessage({ id: message.id, event: message.event,
                                             data: message.data.join("\n") });
        message = { data: [] };
      } else if (!line.startsWith(":")) {
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        let value = colon < 0 ? "" : line.slice(colon + 1);
        if (value.startsWith(" ")) value = value.slice(1);
        if (field === "data") message.data.push(value);
        else if (field === "id" || field === "event") message[field] = value;
      }
    }
  }
}

function showEvent(event) {
  const list = $("#events");
  const when = new Date(event.time * 1000).toLocaleTimeString();
  const item = el("li", { "data-kind": event.kind },
    el("time", {}, when), el("span", { class: "kind" }, (event.model || "") + " " + event.kind),
    " " + (event.reason || ""));
  list.prepend(item);
  while (list.children.length > 100) list.lastChild.remove();
}

let pending = null;
function refreshSoon() {
  if (pending) return;
  pending = setTimeout(() => { pending = null; refresh(); }, 150);
}

async function follow() {
  const live = $("#live");
  for (;;) {
    try {
      const extra = state.lastSeq == null ? {} : { "Last-Event-ID": String(state.lastSeq) };
      const resp = await fetch("/admin/events", { headers: headers("client", extra) });
      if (!resp.ok) throw new Error(await errorText(resp));
      live.textContent = "live";
      live.className = "on";
      refresh();
      await readEvents(resp, (message) => {
        const event = JSON.parse(message.data);
        if (message.id) state.lastSeq = Number(message.id);
        if (event.kind === "load_progress") return;
        if (event.kind.startsWith("pull")) showPullEvent(event);
        if (event.kind === "pull_progress") return;
        showEvent(event);
        refreshSoon();
      });
    } catch (e) {
      live.title = String(e);
    }
    live.textContent = "reconnecting…";
    live.className = "off";
    await new Promise((resolve) => setTimeout(resolve, 2000));
  }
}

async function chat(event) {
  event.preventDefault();
  const output = $("#chat-output");
  const text = $("#chat-input").value.trim();
  const model = $("#chat-model").value;
  if (!text || !model) return;
  output.textContent = "";
  $("#chat-send").disabled = true;
  try {
    // a model without a chat template (a base model) continues the text instead
    const info = state.models.find((m) => m.id === model) || {};
    const chatty = info.kind !== "completion";
    const body = { model, stream: true, max_tokens: 256 };
    if (chatty) body.messages = [{ role: "user", content: text }];
    else body.prompt = text;
    const resp = await fetch(chatty ? "/v1/chat/completions" : "/v1/completions", {
      method: "POST",
      headers: headers("client", { "Content-Type": "application/json" }),
      body: JSON.stringify(body),
    });
    if (!resp.ok) {
      output.textContent = "Error: " + await errorText(resp);
      return;
    }
    await readEvents(resp, (message) => {
      if (message.data === "[DONE]") return;
      const chunk = JSON.parse(message.data);
      if (chunk.error) {
        output.textContent += "\n[error: " + (chunk.error.message || "") + "]";
        return;
      }
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) return;
      const piece = choice.delta ? choice.delta.content : choice.text;
      if (piece) output.textContent += piece;
    });
    output.dataset.done = "true";
  } catch (e) {
    output.textContent += "\n[error: " + e + "]";
  } finally {
    $("#chat-send").disabled = false;
  }
}

// A pull's row: its name, a bar of the bytes fetched, and what it is doing.
function showPull(id, name, completed, total, text, ended) {
  let row = document.getElementById("pull-" + id);
  if (!row) {
    row = el("li", { id: "pull-" + id, class: "pull" }, el("span", { class: "pull-name" }, name),
             el("progress", { max: "1", value: "0" }), el("span", { class: "pull-status" }));
    $("#pulls").prepend(row);
  }
  const bar = row.querySelector("progress");
  if (total) {
    bar.max = total;
    bar.value = Math.min(completed || 0, total);
  }
  if (ended === "ok") bar.value = bar.max;
  row.querySelector(".pull-status").textContent = text;
  if (ended) row.dataset.ended = ended;
}

// A pull that this page did not start (an Ollama client's, another tab's), from the events.
function showPullEvent(event) {
  const data = event.data || {};
  if (!data.pull) return;
  const ended = event.kind === "pulled" ? "ok" : event.kind === "pull_failed" ? "failed" : "";
  showPull(data.pull, event.model, data.completed, data.total, event.reason, ended);
}

async function pull(event) {
  event.preventDefault();
  const note = $("#pull-note");
  const name = $("#pull-model").value.trim();
  note.className = "note";
  note.textContent = "";
  if (!name) return;
  if (!keyFor("admin")) {
    note.textContent = "Pulling needs the admin key: enter it above.";
    note.className = "note bad";
    return;
  }
  let resp;
  try {
    resp = await fetch("/admin/pull", { method: "POST", body: JSON.stringify({ model: name }),
      headers: headers("admin", { "Content-Type": "application/json" }) });
  } catch (e) {
    note.textContent = "cannot reach the server (" + e.message + ")";
    note.className = "note bad";
    return;
  }
  if (!resp.ok) {
    note.textContent = name + ": " + await errorText(resp);
    note.className = "note bad";
    return;
  }
  const id = resp.headers.get("X-Pull-Id");
  const done = {};
  let total = null;
  await readEvents(resp, (message) => {
    const step = JSON.parse(message.data);
    if (step.status === "plan") total = step.total;
    if (step.file) done[step.file] = step.completed;
    const completed = Object.values(done).reduce((a, b) => a + b, 0);
    const text = step.error ? step.error :
      step.status === "success" ? "served as " + step.id :
      step.file && total ? Math.floor(100 * completed / total) + "% of " + mib(total) :
      step.status;
    showPull(id, name, completed, total, text,
             step.error ? "failed" : step.status === "success" ? "ok" : "");
  });
  refresh();
}

async function showVersion() {
  try {
    const resp = await fetch("/api/version", { headers: headers("client") });
    const body = resp.ok ? await resp.json() : {};
    // "version" is the Ollama release the API matches; bunkhouse's own is beside it
    if (body.bunkhouse) $("#version").textContent = "v" + body.bunkhouse;
  } catch (e) {
    // the server is away: the event stream says so
  }
}

async function main() {
  $("#client-key").value = sessionStorage.getItem("bunkhouse.client") || "";
  $("#admin-key").value = sessionStorage.getItem("bunkhouse.admin") || "";
  $("#keys").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem("bunkhouse.client", $("#client-key").value);
    sessionStorage.setItem("bunkhouse.admin", $("#admin-key").value);
    refresh();
    showVersion();
  });
  $("#chat").addEventListener("submit", chat);
  $("#pull").addEventListener("submit", pull);
  showVersion();
  await refresh();  // the recent events first; the stream follows on after them
  follow();
  setInterval(render, 5000);  // idle times; the state itself comes with the events
}

main();
