// The operator console: the pipeline drawn as its stages with live state, memory per stage and
// tag over time, the last sleep/wake ACKs, and buttons whose answer is shown as it came. A
// stage of several processes (`replicas` in /v1/omni/stages) also has a row per replica, with
// its own state, load, memory and buttons (`replica_ids: [i]`).
import { call, describe, message } from "./api.js";
import { lineChart } from "./chart.js";
import { bytes, clock, h, ms } from "./dom.js";

const POLL_MS = 1000;
const HISTORY_MS = 120000; // the memory charts show the last 2 minutes at most
const MIN_WINDOW_MS = 10000; // and at least 10 s (a page just opened)
const ACK_ROWS = 12;
const COLORS = ["#2563eb", "#d97706", "#059669", "#9333ea", "#dc2626"];

export class Console {
  constructor(root, vocabulary) {
    this.vocabulary = vocabulary;
    this.pipeline = root.querySelector("#pipeline");
    this.charts = root.querySelector("#memory-charts");
    this.ackRows = root.querySelector("#acks tbody");
    this.answer = root.querySelector("#answer");
    this.locked = root.querySelector("#console-locked");
    this.cards = new Map(); // stage id -> its card's parts
    this.history = new Map(); // stage id -> [{t, tags: {tag: {resident, released}}}]
    this.acks = []; // newest first: rows of the ACK table
    this.lastSeq = 0;
    this.lastOps = new Map(); // stage id -> {sleep, wake_up}: the last ACKs of each (one per replica)
    this.timer = null;
    this.onStatus = () => {};
  }

  start() {
    this.stop();
    const tick = async () => {
      await this.refresh();
      this.timer = setTimeout(tick, POLL_MS);
    };
    tick();
  }

  stop() {
    clearTimeout(this.timer);
    this.timer = null;
  }

  async refresh() {
    const [stages, acks] = await Promise.all([
      call("v1/omni/stages", { control: true }),
      call(`v1/omni/acks?after=${this.lastSeq}`, { control: true }),
    ]);
    if (!stages.ok) {
      this.locked.hidden = stages.status !== 401;
      this.onStatus(stages.status === 401 ? "locked" : "error", message(stages));
      return;
    }
    this.locked.hidden = true;
    this.onStatus("live", `updated ${new Date().toLocaleTimeString([], { hour12: false })}`);
    if (acks.ok && acks.body.last_seq < this.lastSeq) {
      // A restarted server counts from 1 again: start the table over.
      this.lastSeq = 0;
      this.acks = [];
      this.lastOps.clear();
    } else if (acks.ok) this.addAcks(acks.body.operations);
    const now = Date.now();
    for (const stage of stages.body.stages) {
      this.record(stage, now);
      this.draw(stage);
    }
    this.drawCharts(now);
  }

  record(stage, now) {
    const tags = {};
    for (const [name, memory] of Object.entries(stageTags(stage))) {
      tags[name] = {
        resident: memory.resident_bytes,
        released: memory.released_bytes || 0,
      };
    }
    const samples = this.history.get(stage.stage_id) || [];
    samples.push({ t: now, tags });
    while (samples.length && samples[0].t < now - HISTORY_MS - POLL_MS) samples.shift();
    this.history.set(stage.stage_id, samples);
  }

  // -- the stage cards ----------------------------------------------------------------------

  card(stage) {
    if (this.cards.has(stage.stage_id)) return this.cards.get(stage.stage_id);
    const id = stage.stage_id;
    const parts = {
      title: h("h3", { text: `${id} · ${stage.name || "stage"}` }),
      kind: h("span", { class: "kind", text: stage.kind }),
      state: h("span", { class: "state" }),
      tags: h("div", { class: "sleeping-tags" }),
      counts: h("div", { class: "counts" }),
      weights: h("div", { class: "weights" }),
      memory: h("div", { class: "memory" }),
      last: h("div", { class: "last-ops" }),
      reply: h("div", { class: "reply", "aria-live": "polite" }),
      replicas: null, // a replicated stage's rows (.replicas), made when the stage lists them
      replicaRows: new Map(), // replica id -> its row's parts
      level: h("input", {
        class: "level",
        inputmode: "numeric",
        size: 2,
        value: this.vocabulary.default_level,
        "aria-label": `sleep level of stage ${id}`,
        title: `sleep level (${this.vocabulary.levels.join(", ")})`,
      }),
      mode: h(
        "select",
        { class: "mode", "aria-label": `sleep mode of stage ${id}` },
        h("option", { value: "", text: `mode: default (${this.vocabulary.default_mode})` }),
        this.vocabulary.modes.map((mode) => h("option", { value: mode, text: mode })),
      ),
      tagBoxes: h("span", { class: "tag-boxes" }),
    };
    parts.sleep = h("button", { class: "sleep", type: "button", onclick: () => this.sleep(id) }, "Sleep");
    parts.wake = h("button", { class: "wake", type: "button", onclick: () => this.wake(id) }, "Wake");
    parts.root = h(
      "article",
      { class: "stage", "data-stage-id": id },
      h("header", {}, parts.title, parts.kind, parts.state),
      parts.tags,
      parts.counts,
      parts.weights,
      parts.memory,
      parts.last,
      h(
        "div",
        { class: "controls" },
        h("label", {}, "level ", parts.level),
        parts.mode,
        parts.tagBoxes,
        parts.sleep,
        parts.wake,
      ),
      parts.reply,
    );
    if (this.cards.size) this.pipeline.append(h("div", { class: "arrow", "aria-hidden": "true", text: "→" }));
    this.pipeline.append(parts.root);
    this.cards.set(id, parts);
    return parts;
  }

  draw(stage) {
    const parts = this.card(stage);
    const state = stage.state || "unknown";
    let label = state;
    if (state === "asleep" || state === "sleeping") label = `${state} · level ${stage.level}`;
    if (stage.paused && state === "awake") label += " · paused";
    parts.state.textContent = label;
    parts.state.dataset.state = state;
    parts.root.dataset.state = state;
    parts.root.dataset.paused = String(Boolean(stage.paused));
    parts.tags.replaceChildren(
      ...sleepingTags(stage).map((tag) => h("span", { class: "chip", text: `${tag} asleep` })),
    );
    const counts = [`queue ${stage.num_waiting ?? "–"}`, `running ${stage.num_running ?? "–"}`, `in flight ${stage.in_flight ?? 0}`];
    if (stage.restarts) counts.push(`restarts ${stage.restarts}`);
    parts.counts.textContent = counts.join(" · ");
    const version = stage.weight_version ? `version ${stage.weight_version}` : "checkpoint weights";
    parts.weights.textContent = `${version}${weightsMissing(stage) ? " · weights not loaded" : ""}`;
    if (stage.last_exit) parts.weights.textContent += ` · last exit: ${stage.last_exit}`;
    this.drawMemory(parts, stage);
    this.drawReplicas(parts, stage);
    this.drawTagBoxes(parts, stage);
    this.drawLast(parts, stage.stage_id);
  }

  drawMemory(parts, stage) {
    const tags = Object.entries(stageTags(stage));
    if (!tags.length) {
      parts.memory.textContent = stage.error || "memory: not reported";
      return;
    }
    parts.memory.replaceChildren(
      ...tags.map(([tag, m]) => {
        const share = m.reserved_bytes ? m.resident_bytes / m.reserved_bytes : 0;
        const fill = h("span", { class: "fill" });
        fill.style.width = `${Math.round(share * 100)}%`;
        const released = m.released_bytes || 0; // what a sleep gave back (0 while awake)
        return h(
          "div",
          { class: "tag-memory", "data-tag": tag },
          h("span", { class: "tag-name", text: tag }),
          h("span", { class: "bar", title: `${bytes(m.resident_bytes)} of ${bytes(m.reserved_bytes)} resident` }, fill),
          h("span", { class: "resident", text: `${bytes(m.resident_bytes)} resident` }),
          h("span", { class: "released", text: `${bytes(released)} released` }),
          m.backup_bytes ? h("span", { class: "backup", text: `${bytes(m.backup_bytes)} on host` }) : null,
        );
      }),
    );
  }

  // One row per replica of a replicated stage, under its memory: state, load, memory, and its
  // own Sleep and Wake (the card's level, mode and tags, sent with `replica_ids: [i]`). The
  // rows are kept and updated in place: a click never lands on a row being replaced.
  drawReplicas(parts, stage) {
    if (!Array.isArray(stage.replicas)) {
      parts.replicas?.remove();
      parts.replicas = null;
      parts.replicaRows.clear();
      return;
    }
    if (!parts.replicas) {
      parts.replicas = h("div", { class: "replicas", "aria-label": `replicas of stage ${stage.stage_id}` });
      parts.memory.after(parts.replicas);
    }
    const listed = new Set(stage.replicas.map((replica) => replica.replica_id));
    for (const [id, row] of parts.replicaRows) {
      if (!listed.has(id)) {
        row.root.remove();
        parts.replicaRows.delete(id);
      }
    }
    for (const replica of stage.replicas) {
      const row = this.replicaRow(parts, stage.stage_id, replica.replica_id);
      drawReplica(row, replica);
    }
  }

  replicaRow(parts, stageId, replicaId) {
    if (parts.replicaRows.has(replicaId)) return parts.replicaRows.get(replicaId);
    const name = `replica ${replicaId} of stage ${stageId}`;
    const row = {
      state: h("span", { class: "replica-state" }),
      load: h("div", { class: "replica-load" }),
      fill: h("span", { class: "fill" }),
      bytes: h("span", { class: "replica-bytes" }),
      sleep: h(
        "button",
        { class: "replica-sleep", type: "button", "aria-label": `sleep ${name}`, onclick: () => this.sleep(stageId, replicaId) },
        "Sleep",
      ),
      wake: h(
        "button",
        { class: "replica-wake", type: "button", "aria-label": `wake ${name}`, onclick: () => this.wake(stageId, replicaId) },
        "Wake",
      ),
    };
    row.bar = h("span", { class: "bar" }, row.fill);
    row.root = h(
      "div",
      { class: "replica", "data-replica-id": replicaId },
      h(
        "div",
        { class: "replica-head" },
        h("span", { class: "replica-name", text: `replica ${replicaId}` }),
        row.state,
        h("span", { class: "replica-buttons" }, row.sleep, row.wake),
      ),
      row.load,
      h("div", { class: "replica-memory" }, row.bar, row.bytes),
    );
    // in replica-id order, whatever order they were first listed in
    const after = [...parts.replicaRows.keys()].filter((id) => id < replicaId).sort((a, b) => a - b).pop();
    if (after === undefined) parts.replicas.prepend(row.root);
    else parts.replicaRows.get(after).root.after(row.root);
    row.sleep.disabled = row.wake.disabled = parts.sleep.disabled; // a call under way
    parts.replicaRows.set(replicaId, row);
    return row;
  }

  drawTagBoxes(parts, stage) {
    const tags = Object.keys(stageTags(stage));
    const shown = [...parts.tagBoxes.querySelectorAll("input")].map((box) => box.value);
    if (shown.join() === tags.join()) return;
    parts.tagBoxes.replaceChildren(
      ...tags.map((tag) => h("label", { class: "tag-box" }, h("input", { type: "checkbox", value: tag }), tag)),
    );
    parts.tagBoxes.title = "tags to sleep or wake (none ticked: every tag)";
  }

  drawLast(parts, stageId) {
    const last = this.lastOps.get(stageId) || {};
    const lines = [];
    if (last.sleep) {
      const { of, each, m } = acksOf(last.sleep);
      // freed_bytes is the process's own drop (RSS on the CPU): a level-1 sleep moves the
      // weights to a host copy, which the process still holds
      const backup = each((ack) => ack.metadata?.host_backup_bytes, sum);
      const kept = backup ? `, ${bytes(backup)} kept on host` : "";
      const who = last.sleep.length > 1 ? "processes" : "process";
      const freed = bytes(each((ack) => ack.freed_bytes, sum));
      lines.push(`last sleep${of}: level ${m.level} in ${ms(each((ack) => ack.metadata?.latency_ms, max))}: ${who} freed ${freed}${kept}`);
    }
    if (last.wake_up) {
      const { of, each, m } = acksOf(last.wake_up);
      // GB/s is each process's own: shown for one
      const rate = last.wake_up.length === 1 && m.gbps ? ` (${m.gbps} GB/s)` : "";
      const restored = bytes(each((ack) => ack.metadata?.restored_bytes, sum));
      lines.push(`last wake${of}: ${restored} back in ${ms(each((ack) => ack.metadata?.latency_ms, max))}${rate}`);
    }
    parts.last.replaceChildren(...lines.map((line) => h("div", { text: line })));
  }

  // -- the buttons --------------------------------------------------------------------------

  chosenTags(parts) {
    const ticked = [...parts.tagBoxes.querySelectorAll("input:checked")].map((box) => box.value);
    return ticked.length ? ticked : undefined;
  }

  // replicaId: that replica of the stage only (`replica_ids`); undefined: the whole stage.
  async sleep(stageId, replicaId) {
    const parts = this.cards.get(stageId);
    const typed = parts.level.value.trim();
    // Sent as typed: a number when it reads as one, else the text; the server judges it.
    const level = /^-?\d+$/.test(typed) ? Number(typed) : typed;
    const body = { stage_ids: [stageId] };
    if (replicaId !== undefined) body.replica_ids = [replicaId];
    body.level = level;
    if (parts.mode.value) body.mode = parts.mode.value;
    const tags = this.chosenTags(parts);
    if (tags) body.tags = tags;
    await this.act(parts, "v1/omni/sleep", body);
  }

  async wake(stageId, replicaId) {
    const parts = this.cards.get(stageId);
    const body = { stage_ids: [stageId] };
    if (replicaId !== undefined) body.replica_ids = [replicaId];
    const tags = this.chosenTags(parts);
    if (tags) body.tags = tags;
    await this.act(parts, "v1/omni/wakeup", body);
  }

  async act(parts, path, body) {
    const buttons = () => [parts.sleep, parts.wake, ...[...parts.replicaRows.values()].flatMap((row) => [row.sleep, row.wake])];
    for (const button of buttons()) button.disabled = true;
    parts.reply.textContent = `POST /${path} …`;
    parts.reply.dataset.status = "pending";
    const answer = await call(path, { method: "POST", body, control: true });
    for (const button of buttons()) button.disabled = false;
    const summary = answer.ok ? answer.body?.status || "OK" : message(answer);
    parts.reply.textContent = `HTTP ${answer.status} · ${summary}${answer.body?.reason ? ` · ${answer.body.reason}` : ""}`;
    parts.reply.dataset.status = String(answer.status);
    this.answer.textContent = `POST /${path} ${JSON.stringify(body)}\n${describe(answer)}`;
    this.answer.dataset.status = String(answer.status);
    await this.refresh(); // the new state now, not at the next tick
  }

  // -- the ACK table and the charts ---------------------------------------------------------

  addAcks(operations) {
    for (const op of operations) {
      this.lastSeq = Math.max(this.lastSeq, op.seq);
      const succeeded = new Map(); // stage id -> this operation's rank-0 SUCCESS ACKs (one a replica)
      for (const ack of op.acks) {
        this.acks.unshift({ op, ack });
        if (ack.status === "SUCCESS" && (ack.rank ?? 0) === 0) {
          succeeded.set(ack.stage_id, [...(succeeded.get(ack.stage_id) || []), ack]);
        }
      }
      for (const [stageId, acks] of succeeded) {
        const last = this.lastOps.get(stageId) || {};
        last[op.operation] = acks;
        this.lastOps.set(stageId, last);
      }
    }
    this.acks.length = Math.min(this.acks.length, ACK_ROWS);
    this.ackRows.replaceChildren(
      ...this.acks.map(({ op, ack }) => {
        const m = ack.metadata || {};
        const gbps = m.reload_gbps ? `${m.gbps} (reload ${m.reload_gbps})` : m.gbps ? String(m.gbps) : "–";
        return h(
          "tr",
          { "data-status": ack.status },
          h("td", { text: clock(op.time) }),
          h("td", { text: op.operation }),
          h("td", { text: `${ack.stage_id}${replicaOf(ack)}${ack.rank ? `/${ack.rank}` : ""}` }),
          h("td", { class: "status", text: ack.status }),
          h("td", { text: m.level ?? "–" }),
          h("td", { class: "tags", text: (m.tags || []).join(", ") || "–" }),
          h("td", { class: "num", text: ms(m.latency_ms) }),
          h("td", { class: "num", text: bytes(ack.freed_bytes) }),
          h("td", { class: "num", text: bytes(m.restored_bytes) }),
          h("td", { class: "num", text: gbps }),
          h("td", { class: "message", text: ack.error_msg || "" }),
        );
      }),
    );
  }

  drawCharts(now) {
    const charts = [];
    const first = Math.min(...[...this.history.values()].map((samples) => samples[0]?.t ?? now));
    const windowMs = Math.min(HISTORY_MS, Math.max(MIN_WINDOW_MS, now - first));
    for (const [stageId, samples] of this.history) {
      const tags = Object.keys(samples[samples.length - 1]?.tags || {});
      const series = [];
      tags.forEach((tag, i) => {
        const color = COLORS[i % COLORS.length];
        const points = (key) => samples.filter((x) => x.tags[tag]).map((x) => [x.t, x.tags[tag][key]]);
        series.push({ label: `${tag} resident`, color, points: points("resident") });
        series.push({ label: `${tag} released`, color, dashed: true, points: points("released") });
      });
      const legend = h(
        "div",
        { class: "legend" },
        series.map((line) => h("span", { class: line.dashed ? "key dashed" : "key", "data-color": line.color }, line.label)),
      );
      for (const key of legend.querySelectorAll(".key")) key.style.borderColor = key.dataset.color;
      const title = this.cards.get(stageId)?.title.textContent || `stage ${stageId}`;
      charts.push(h("figure", { class: "memory-chart", "data-stage-id": stageId }, h("figcaption", { text: title }), lineChart(series, windowMs, now), legend));
    }
    this.charts.replaceChildren(...charts);
  }
}

// -- a replicated stage ---------------------------------------------------------------------

const MEMORY_FIELDS = ["reserved_bytes", "resident_bytes", "released_bytes", "backup_bytes"];

// The stage's memory per tag: a replicated stage's is its replicas' added up (each holds its own
// copy), a stage of one process's as it reports it.
function stageTags(stage) {
  if (!Array.isArray(stage.replicas)) return stage.memory?.tags || {};
  const tags = {};
  for (const replica of stage.replicas) {
    for (const [tag, m] of Object.entries(replica.memory?.tags || {})) {
      tags[tag] ||= Object.fromEntries(MEMORY_FIELDS.map((field) => [field, 0]));
      for (const field of MEMORY_FIELDS) tags[tag][field] += m[field] || 0;
    }
  }
  return tags;
}

// The tags asleep in the stage: a replicated stage's, those asleep in every replica that says.
function sleepingTags(stage) {
  if (!Array.isArray(stage.replicas)) return stage.sleeping_tags || [];
  const lists = stage.replicas.map((replica) => replica.sleeping_tags).filter(Array.isArray);
  return lists.length ? lists[0].filter((tag) => lists.every((list) => list.includes(tag))) : [];
}

// Whether the stage serves without its weights: a replicated stage, when no replica has them.
function weightsMissing(stage) {
  if (!Array.isArray(stage.replicas)) return stage.weights_valid === false;
  return stage.replicas.length > 0 && stage.replicas.every((replica) => replica.weights_valid === false);
}

function drawReplica(row, replica) {
  const state = replica.state || "unknown";
  let label = state;
  if (state === "asleep" && replica.level !== null && replica.level !== undefined) label += ` · level ${replica.level}`;
  if (replica.restarting) label += " · restarting";
  row.state.textContent = label;
  row.state.dataset.state = state;
  row.root.dataset.state = state;
  row.root.dataset.restarting = String(Boolean(replica.restarting));
  const load = [`in flight ${replica.in_flight ?? 0}`];
  if (typeof replica.num_running === "number") load.push(`running ${replica.num_running}`);
  load.push(`pid ${replica.pid ?? "–"}`);
  if (replica.sleeping_tags?.length) load.push(`${replica.sleeping_tags.join(", ")} asleep`);
  // (a level-2 sleep drops the weights: said only of a replica that is up without them)
  else if (replica.weights_valid === false) load.push("weights not loaded");
  if (replica.error) load.push(replica.error);
  row.load.textContent = load.join(" · ");
  const m = replica.memory;
  if (!m || typeof m !== "object") {
    row.fill.style.width = "0%";
    row.bar.title = "";
    row.bytes.textContent = "memory: not reported";
    return;
  }
  const share = m.reserved_bytes ? m.resident_bytes / m.reserved_bytes : 0;
  row.fill.style.width = `${Math.round(share * 100)}%`;
  row.bar.title = `${bytes(m.resident_bytes)} of ${bytes(m.reserved_bytes)} resident`;
  const backup = m.backup_bytes ? ` · ${bytes(m.backup_bytes)} on host` : "";
  row.bytes.textContent = `${bytes(m.resident_bytes)} resident · ${bytes(m.released_bytes || 0)} released${backup}`;
}

// ".1" for the ACK of replica 1 (as `omnistage ctl` writes it), "" for a stage of one process.
function replicaOf(ack) {
  return ack.replica_id === null || ack.replica_id === undefined ? "" : `.${ack.replica_id}`;
}

const sum = (values) => values.reduce((total, value) => total + (value || 0), 0);
const max = (values) => Math.max(...values.map((value) => value || 0));

// One operation's ACKs of a stage (one, or one a replica): " of replicas 0, 1" for replicas,
// a figure of each put together (`combine`; one ACK's as it is), the first's metadata.
function acksOf(acks) {
  const ids = acks.map((ack) => ack.replica_id).filter((id) => id !== null && id !== undefined);
  const of = ids.length ? ` of replica${ids.length > 1 ? "s" : ""} ${ids.join(", ")}` : "";
  const each = (get, combine) => (acks.length === 1 ? get(acks[0]) : combine(acks.map(get)));
  return { of, each, m: acks[0].metadata || {} };
}
