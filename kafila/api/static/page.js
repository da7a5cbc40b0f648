// The member page: reads /session and /traces every two seconds, streams chat answers from the
// OpenAI route. No libraries: it must work offline.
"use strict";

const $ = (id) => document.getElementById(id);
const ms = (v) => (v === null || v === undefined || Number.isNaN(v) ? "–" : `${Number(v).toFixed(1)} ms`);

function cell(text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

function fill(tbody, rows) {
  tbody.replaceChildren(...rows.map((cells) => {
    const tr = document.createElement("tr");
    tr.append(...cells.cells);
    for (const [k, v] of Object.entries(cells.data || {})) tr.dataset[k] = v;
    return tr;
  }));
}

// measured per stage: the head's request records (the whole ring), else this member's stage records
function measuredByMember(traces) {
  const out = {};
  for (const t of traces) {
    if (t.type === "request") {
      for (const s of t.stages) if (s.steps > 0) out[s.member] = s.measured_ms;
    } else if (t.type === "stage" && t.decode_steps > 0) {
      out[t.member] = t.decode_ms;
    }
  }
  return out;
}

function hopsByEdge(traces) {
  const out = {};
  for (const t of traces) {
    const hops = t.type === "request" ? t.hops : t.type === "stage" ? [t.hop_in, t.hop_out] : [];
    for (const h of hops || []) if (h) out[`${h.src}->${h.dst}`] = h;
  }
  return out;
}

let model = null; // the session's model id, from /session: the OpenAI route requires it

// The API key, where the member asks for one (--api-key-file): asked for on the first 401 and kept
// for this tab only (sessionStorage), sent as a bearer token with every request the page makes.
const KEY_SLOT = "kafila-api-key";
class NeedsKey extends Error {}

async function api(path, init = {}) {
  const key = sessionStorage.getItem(KEY_SLOT);
  const headers = { ...(init.headers || {}), ...(key ? { Authorization: `Bearer ${key}` } : {}) };
  const response = await fetch(path, { ...init, headers });
  if (response.status === 401) {
    const refused = await response.json().catch(() => ({}));
    askForKey(key ? (refused.error && refused.error.message) || "the key was refused" : "");
    throw new NeedsKey("this member's API asks for a key");
  }
  return response;
}

function askForKey(why) {
  $("key-form").hidden = false;
  $("key-note").textContent = why ? `${why}; kept for this tab only` : "kept for this tab only (sessionStorage)";
  $("state").textContent = "needs a key";
  $("state").className = "state broken";
}

function useKey(event) {
  event.preventDefault();
  const key = $("api-key").value.trim();
  if (!key) return;
  sessionStorage.setItem(KEY_SLOT, key);
  $("api-key").value = "";
  $("key-form").hidden = true;
  refresh();
}

function describeChange(doc) {
  const c = doc.change;
  if (!doc.epoch) return "";
  if (!c || !c.at) return `epoch ${doc.epoch}`;
  const when = new Date(c.at * 1000).toLocaleTimeString();
  return `epoch ${doc.epoch} · last change ${when}: ${c.state}${c.cause ? ` (${c.cause})` : ""}`;
}

function render(doc, traces) {
  if (doc.model) model = doc.model;
  const state = doc.state || "unknown";
  $("state").textContent = state;
  $("state").className = `state ${state}`;
  const ring = doc.ring || [];
  $("summary").textContent = ring.length
    ? `session ${doc.session} · ${doc.model} · ${ring.length} members · this is ${doc.me}` + (doc.error ? ` · ${doc.error}` : "")
    : (doc.error || "");
  $("change").textContent = describeChange(doc);
  const measured = measuredByMember(traces);
  fill($("members").tBodies[0], (doc.members || []).map((m, i) => {
    const got = measured[m.name];
    const ratio = got !== undefined && m.predicted_ms ? got / m.predicted_ms : null;
    return {
      data: { member: m.name },
      cells: [
        cell(String(ring.indexOf(m.name) >= 0 ? ring.indexOf(m.name) : i)),
        cell(m.name + (m.name === doc.me ? " (this member)" : "")),
        cell(`${m.blocks[0]}–${m.blocks[1]} (${m.blocks[1] - m.blocks[0]})`),
        cell(m.name === doc.head ? "head" : "stage"),
        cell(m.nat_class ? `${m.nat_class}${m.mapping ? ` (${m.mapping})` : ""}` : "–"),
        cell(ms(m.predicted_ms)),
        cell(ms(got), "measured"),
        cell(ratio === null ? "–" : ratio.toFixed(2), ratio !== null && ratio > 1.25 ? "slow" : ""),
      ],
    };
  }));
  const hops = hopsByEdge(traces);
  fill($("edges").tBodies[0], (doc.links || []).map((l) => {
    const h = hops[l.edge];
    // /session's link: "path" it runs, "planned_path", "measured_by" (a member; absent: predicted);
    // without those fields, this member's traces measured the edges it owns
    const measured = h && h.path !== "local" ? h.path : null;
    const runs = l.measured_by ? l.path : measured || l.path;
    const by = l.measured_by ? ` (measured by ${l.measured_by})` : measured ? " (measured)" : " (planned)";
    return {
      data: { edge: l.edge },
      cells: [
        cell(l.edge),
        cell(l.planned_path || l.path, l.planned_path || l.path),
        cell(runs + by, runs),
        cell(h && h.rtt_ms !== null ? ms(h.rtt_ms) : "–"),
        cell(h && h.predicted_rtt_ms !== null ? ms(h.predicted_rtt_ms) : "–"),
      ],
    };
  }));
  const requests = traces.filter((t) => t.type === "request").slice(-10).reverse();
  fill($("requests").tBodies[0], requests.map((r) => ({
    data: { request: r.request_id },
    cells: [
      cell(String(r.request_id)), cell(r.finish),
      cell(`${r.prompt_tokens} → ${r.completion_tokens}`),
      cell(`${(r.ttft_s * 1000).toFixed(0)} ms`),
      cell(r.tokens_per_s ? r.tokens_per_s.toFixed(1) : "–"),
      cell(ms(r.circuit_ms)),
    ],
  })));
  const stages = traces.filter((t) => t.type === "stage").length;
  $("requests-note").textContent = requests.length
    ? ""
    : stages ? `This member is not the head: it holds ${stages} record${stages === 1 ? "" : "s"} of its own stage; the head's page lists requests.`
      : "No request yet.";
}

async function refresh() {
  try {
    const [doc, tr] = await Promise.all([
      api("/session").then((r) => r.json()),
      api("/traces").then((r) => (r.ok ? r.json() : { traces: [] })),
    ]);
    render(doc, tr.traces || []);
  } catch (err) {
    if (err instanceof NeedsKey) return;
    $("state").textContent = "unreachable";
    $("state").className = "state broken";
  }
}

// One streamed answer: POST /v1/chat/completions with stream=true, read its server-sent events.
async function ask(event) {
  event.preventDefault();
  const prompt = $("prompt").value.trim();
  if (!prompt) return;
  if (!model) await refresh();
  const answer = $("answer");
  answer.textContent = "";
  $("send").disabled = true;
  $("chat-status").textContent = "asking…";
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({
        model, messages: [{ role: "user", content: prompt }], stream: true,
        max_tokens: Number($("max-tokens").value), temperature: Number($("temperature").value),
      }),
    });
    if (!response.ok) throw new Error(`${response.status}: ${(await response.text()).slice(0, 300)}`);
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "", chunks = 0;
    for (;;) {
      const { done, value } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of block.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message);
          const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
          if (delta && delta.content) {
            answer.textContent += delta.content;
            chunks += 1;
          }
        }
      }
    }
    $("chat-status").textContent = `streamed in ${chunks} chunks`;
    $("chat-status").dataset.done = "1";
  } catch (err) {
    $("chat-status").textContent = `failed: ${err.message}`;
    $("chat-status").dataset.done = "error";
  } finally {
    $("send").disabled = false;
    refresh();
  }
}

$("chat").addEventListener("submit", ask);
$("key-form").addEventListener("submit", useKey);
refresh();
setInterval(refresh, 2000);
