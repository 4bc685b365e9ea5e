// The operator console: the pipeline drawn as its stages with live state, memory per stage and
// tag over time, the last sleep/wake ACKs, and buttons whose answer is shown as it came.
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
    this.lastOps = new Map(); // stage id -> {sleep, wake_up}: the last ACK of each
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
    for (const [name, memory] of Object.entries(stage.memory?.tags || {})) {
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
      ...(stage.sleeping_tags || []).map((tag) => h("span", { class: "chip", text: `${tag} asleep` })),
    );
    const counts = [`queue ${stage.num_waiting ?? "–"}`, `running ${stage.num_running ?? "–"}`, `in flight ${stage.in_flight ?? 0}`];
    if (stage.restarts) counts.push(`restarts ${stage.restarts}`);
    parts.counts.textContent = counts.join(" · ");
    const version = stage.weight_version ? `version ${stage.weight_version}` : "checkpoint weights";
    parts.weights.textContent = `${version}${stage.weights_valid === false ? " · weights not loaded" : ""}`;
    if (stage.last_exit) parts.weights.textContent += ` · last exit: ${stage.last_exit}`;
    this.drawMemory(parts, stage);
    this.drawTagBoxes(parts, stage);
    this.drawLast(parts, stage.stage_id);
  }

  drawMemory(parts, stage) {
    const tags = Object.entries(stage.memory?.tags || {});
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

  drawTagBoxes(parts, stage) {
    const tags = Object.keys(stage.memory?.tags || {});
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
      const m = last.sleep.metadata || {};
      // freed_bytes is the process's own drop (RSS on the CPU): a level-1 sleep moves the
      // weights to a host copy, which the process still holds
      const kept = m.host_backup_bytes ? `, ${bytes(m.host_backup_bytes)} kept on host` : "";
      lines.push(`last sleep: level ${m.level} in ${ms(m.latency_ms)}: process freed ${bytes(last.sleep.freed_bytes)}${kept}`);
    }
    if (last.wake_up) {
      const m = last.wake_up.metadata || {};
      const rate = m.gbps ? ` (${m.gbps} GB/s)` : "";
      lines.push(`last wake: ${bytes(m.restored_bytes)} back in ${ms(m.latency_ms)}${rate}`);
    }
    parts.last.replaceChildren(...lines.map((line) => h("div", { text: line })));
  }

  // -- the buttons --------------------------------------------------------------------------

  chosenTags(parts) {
    const ticked = [...parts.tagBoxes.querySelectorAll("input:checked")].map((box) => box.value);
    return ticked.length ? ticked : undefined;
  }

  async sleep(stageId) {
    const parts = this.cards.get(stageId);
    const typed = parts.level.value.trim();
    // Sent as typed: a number when it reads as one, else the text; the server judges it.
    const level = /^-?\d+$/.test(typed) ? Number(typed) : typed;
    const body = { stage_ids: [stageId], level };
    if (parts.mode.value) body.mode = parts.mode.value;
    const tags = this.chosenTags(parts);
    if (tags) body.tags = tags;
    await this.act(parts, "v1/omni/sleep", body);
  }

  async wake(stageId) {
    const parts = this.cards.get(stageId);
    const body = { stage_ids: [stageId] };
    const tags = this.chosenTags(parts);
    if (tags) body.tags = tags;
    await this.act(parts, "v1/omni/wakeup", body);
  }

  async act(parts, path, body) {
    parts.sleep.disabled = parts.wake.disabled = true;
    parts.reply.textContent = `POST /${path} …`;
    parts.reply.dataset.status = "pending";
    const answer = await call(path, { method: "POST", body, control: true });
    parts.sleep.disabled = parts.wake.disabled = false;
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
      for (const ack of op.acks) {
        this.acks.unshift({ op, ack });
        if (ack.status === "SUCCESS" && (ack.rank ?? 0) === 0) {
          const last = this.lastOps.get(ack.stage_id) || {};
          last[op.operation] = ack;
          this.lastOps.set(ack.stage_id, last);
        }
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
          h("td", { text: `${ack.stage_id}${ack.rank ? `/${ack.rank}` : ""}` }),
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
