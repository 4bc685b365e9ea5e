// The playground: chat with the served model — text, attached or recorded audio, attached
// images — with the reply's text, images and speech shown as they stream in (speech played
// piece by piece as it arrives).
import { call, describe, events, message, stream } from "./api.js";
import { PcmStream, Recorder, StreamPlayer, toWav } from "./audio.js";
import { h } from "./dom.js";

// input_audio formats the chat route decodes as they are; other audio becomes WAV here.
const AUDIO_FORMATS = { "audio/wav": "wav", "audio/x-wav": "wav", "audio/wave": "wav", "audio/flac": "flac", "audio/mpeg": "mp3", "audio/ogg": "ogg" };

function base64(bytes) {
  let binary = "";
  for (let i = 0; i < bytes.length; i += 0x8000) binary += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(binary);
}

export class Playground {
  constructor(root) {
    this.root = root;
    this.log = root.querySelector("#chat-log");
    this.input = root.querySelector("#chat-input");
    this.form = root.querySelector("#chat-form");
    this.attachments = root.querySelector("#attachments");
    this.modalities = root.querySelector("#modalities");
    this.send = root.querySelector("#send");
    this.stopButton = root.querySelector("#stop");
    this.record = root.querySelector("#record");
    this.messages = []; // the conversation as sent to the server
    this.pending = []; // [{kind, name, part}] attached to the next message
    this.player = new StreamPlayer();
    this.recorder = null;
    this.abort = null;
    this.model = null;
    this.form.addEventListener("submit", (event) => {
      event.preventDefault();
      this.submit();
    });
    this.input.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey) {
        event.preventDefault();
        this.submit();
      }
    });
    root.querySelector("#attach").addEventListener("change", (event) => this.attach(event.target));
    root.querySelector("#new-chat").addEventListener("click", () => this.reset());
    this.stopButton.addEventListener("click", () => {
      this.abort?.abort();
      this.player.stop();
    });
    if (Recorder.available) this.record.addEventListener("click", () => this.toggleRecording());
    else {
      this.record.disabled = true;
      this.record.title = "recording needs a microphone and a secure page (https, or localhost)";
    }
  }

  // The served model's id and what it can answer in (from /v1/models).
  setModel(card) {
    this.model = card?.id || null;
    const offered = card?.modalities || ["text"];
    this.root.querySelector("#speech-options").hidden = !offered.includes("audio");
    this.modalities.replaceChildren(
      ...offered.map((name) =>
        h("label", {}, h("input", { type: "checkbox", name: "modality", value: name, checked: name === "text" }), name),
      ),
    );
  }

  reset() {
    this.abort?.abort();
    this.player.stop();
    this.messages = [];
    this.pending = [];
    this.log.replaceChildren();
    this.drawAttachments();
  }

  // -- attachments --------------------------------------------------------------------------

  async attach(input) {
    for (const file of input.files) {
      try {
        if (file.type.startsWith("image/")) await this.addImage(file);
        else await this.addAudio(file, file.name);
      } catch (error) {
        this.pending.push({ kind: "error", name: `${file.name}: ${error.message || error}` });
      }
    }
    input.value = "";
    this.drawAttachments();
  }

  async addImage(file) {
    const url = await new Promise((resolve, reject) => {
      const reader = new FileReader();
      reader.onload = () => resolve(reader.result);
      reader.onerror = () => reject(reader.error);
      reader.readAsDataURL(file);
    });
    this.pending.push({ kind: "image", name: file.name, url, part: { type: "image_url", image_url: { url } } });
  }

  async addAudio(blob, name) {
    let bytes = new Uint8Array(await blob.arrayBuffer());
    let format = AUDIO_FORMATS[blob.type] || AUDIO_FORMATS[`audio/${name.split(".").pop().toLowerCase()}`];
    if (!format) {
      bytes = await toWav(bytes.buffer); // a recording's WebM/Opus, or what the server does not read
      format = "wav";
    }
    const url = URL.createObjectURL(new Blob([bytes], { type: `audio/${format}` }));
    this.pending.push({ kind: "audio", name, url, part: { type: "input_audio", input_audio: { data: base64(bytes), format } } });
  }

  async toggleRecording() {
    if (this.starting) return; // the microphone is still being opened
    if (this.recorder) {
      const recorder = this.recorder;
      this.recorder = null;
      recorder.onpart = () => {};
      this.record.textContent = "Record";
      this.record.classList.remove("recording");
      const blob = await recorder.stop();
      try {
        await this.addAudio(blob, `recording ${new Date().toLocaleTimeString([], { hour12: false })}`);
      } catch (error) {
        const short = recorder.parts.length < 2 ? " (too short? record for a moment longer)" : "";
        this.pending.push({ kind: "error", name: `recording: ${error.message || error}${short}` });
      }
      delete this.record.dataset.seconds;
      this.drawAttachments();
      return;
    }
    const recorder = new Recorder();
    recorder.onpart = (seconds) => {
      this.record.dataset.seconds = String(seconds);
      this.record.textContent = `Stop recording (${seconds.toFixed(1)} s)`;
    };
    this.starting = true;
    try {
      await recorder.start();
      this.recorder = recorder;
      this.record.textContent = "Stop recording";
      this.record.classList.add("recording");
    } catch (error) {
      this.pending.push({ kind: "error", name: `microphone: ${error.message || error}` });
      this.drawAttachments();
    } finally {
      this.starting = false;
    }
  }

  drawAttachments() {
    this.attachments.replaceChildren(
      ...this.pending.map((item, i) =>
        h(
          "span",
          { class: `chip attachment ${item.kind}` },
          item.kind === "image" ? h("img", { src: item.url, alt: item.name }) : null,
          item.kind === "audio" ? h("audio", { src: item.url, controls: true }) : null,
          h("span", { text: item.name }),
          h("button", { type: "button", title: "remove", onclick: () => { this.pending.splice(i, 1); this.drawAttachments(); } }, "×"),
        ),
      ),
    );
  }

  // -- a turn -------------------------------------------------------------------------------

  options() {
    const value = (id) => this.root.querySelector(id).value.trim();
    const number = (text) => (text === "" ? undefined : /^-?\d+(\.\d+)?$/.test(text) ? Number(text) : text);
    const modalities = [...this.modalities.querySelectorAll("input:checked")].map((box) => box.value);
    const body = { model: this.model || undefined, max_tokens: number(value("#max-tokens")), temperature: number(value("#temperature")) };
    // Always said: a request without modalities asks for every output the pipeline makes.
    if (modalities.length) body.modalities = modalities;
    if (modalities.includes("audio")) {
      body.audio = { format: value("#audio-format") };
      const speechTokens = number(value("#speech-tokens"));
      if (speechTokens !== undefined) body.talker_params = { max_tokens: speechTokens };
    }
    return body;
  }

  async submit() {
    if (this.abort) return;
    const text = this.input.value.trim();
    const media = this.pending.filter((item) => item.part);
    if (!text && !media.length) return;
    this.player.unlock(); // a user's gesture: speech may play
    const content = media.length ? [...media.map((item) => item.part), ...(text ? [{ type: "text", text }] : [])] : text;
    this.messages.push({ role: "user", content });
    const shown = media.map((item) =>
      item.kind === "image"
        ? h("img", { src: item.url, alt: item.name, title: item.name, class: "sent-image" })
        : h("audio", { src: item.url, controls: true, title: item.name }),
    );
    this.log.append(h("div", { class: "msg user" }, h("div", { class: "media" }, shown), text ? h("div", { class: "text", text }) : null));
    this.input.value = "";
    this.pending = [];
    this.drawAttachments();
    const body = { ...this.options(), messages: this.messages, stream: this.root.querySelector("#stream").checked };
    const bubble = new Reply(this.log, body.audio?.format || "wav", this.player);
    this.abort = new AbortController();
    this.send.disabled = true;
    this.stopButton.hidden = false;
    try {
      const content = body.stream ? await this.streamed(body, bubble) : await this.whole(body, bubble);
      if (content !== null) this.messages.push({ role: "assistant", content });
      else this.messages.pop(); // refused: the turn is not part of the conversation
    } catch (error) {
      bubble.fail(error.name === "AbortError" ? "stopped" : String(error));
      this.messages.pop();
    } finally {
      bubble.done();
      this.abort = null;
      this.send.disabled = false;
      this.stopButton.hidden = true;
      this.log.scrollTop = this.log.scrollHeight;
    }
  }

  async whole(body, bubble) {
    const answer = await call("v1/chat/completions", { method: "POST", body, signal: this.abort.signal });
    if (!answer.ok) return bubble.refused(answer);
    // OpenAI's shape (one choice with everything) or vLLM-Omni's (a choice per output, the
    // pictures as content parts): the first sample's choices either way.
    const choices = answer.body.choices.filter((choice) => choice.index === 0);
    let text = "";
    let transcript = "";
    for (const { message } of choices) {
      if (typeof message.content === "string") text = message.content;
      const pictures = Array.isArray(message.content) ? message.content : message.images || [];
      for (const part of pictures) bubble.image(part.image_url.url);
      if (message.audio) {
        transcript = message.audio.transcript;
        bubble.transcript(transcript);
        bubble.audio(message.audio.id, message.audio.data);
      }
    }
    bubble.text(text);
    bubble.finish(choices[0].finish_reason, answer.body.usage);
    return text || transcript || "";
  }

  async streamed(body, bubble) {
    body.stream_options = { include_usage: true };
    const started = await stream("v1/chat/completions", body, this.abort.signal);
    if (!started.ok || !started.response) return bubble.refused(started);
    let text = "";
    let speechChunks = 0;
    for await (const data of events(started.response)) {
      if (data === "[DONE]") break;
      const event = JSON.parse(data);
      if (event.error) {
        // A failure after the stream began, in the shape of the HTTP error reply.
        bubble.fail(`error in the stream:\n${JSON.stringify(event, null, 2)}`, event.error.message);
        continue;
      }
      if (event.usage) bubble.usage = event.usage;
      for (const choice of event.choices || []) {
        if (choice.index !== 0) continue;
        const delta = choice.delta || {};
        if (event.modality === "audio") {
          // vLLM-Omni's shape (a server with --chat-dialect vllm-omni): each chunk a file.
          if (delta.content) bubble.audio(`${event.id}-${++speechChunks}`, delta.content);
        } else if (typeof delta.content === "string" && delta.content) {
          text += delta.content;
          bubble.text(text);
        }
        // Pictures as OpenAI-shaped delta.images or vLLM-Omni's image chunk's content parts.
        const pictures = Array.isArray(delta.content) ? delta.content : delta.images || [];
        for (const part of pictures) bubble.image(part.image_url.url);
        if (delta.audio) {
          if (delta.audio.transcript !== undefined) bubble.transcript(delta.audio.transcript);
          if (delta.audio.data) bubble.audio(delta.audio.id, delta.audio.data);
        }
        if (choice.finish_reason) bubble.finish(choice.finish_reason);
      }
    }
    return text || bubble.said || "";
  }
}

// One assistant message as it arrives.
class Reply {
  constructor(log, format, player) {
    this.started = performance.now();
    this.format = format;
    this.player = player;
    this.streams = new Map(); // audio id -> PcmStream
    this.said = "";
    this.usage = null;
    this.firstText = null;
    this.firstAudio = null;
    this.reason = null;
    this.body = h("div", { class: "text" });
    this.media = h("div", { class: "media" });
    this.speech = h("div", { class: "speech" });
    this.meta = h("div", { class: "meta", text: "…" });
    this.root = h("div", { class: "msg assistant pending" }, this.body, this.media, this.speech, this.meta);
    log.append(this.root);
  }

  since() {
    return Math.round(performance.now() - this.started);
  }

  text(value) {
    this.firstText ??= this.since();
    this.body.textContent = value;
  }

  image(url) {
    this.media.append(h("img", { src: url, alt: "generated image", class: "reply-image" }));
  }

  transcript(value) {
    this.said = value || this.said;
  }

  audio(id, data) {
    let pcm = this.streams.get(id);
    if (!pcm) {
      pcm = new PcmStream(this.format);
      this.streams.set(id, pcm);
    }
    try {
      const samples = pcm.push(data);
      if (samples) {
        this.firstAudio ??= this.since();
        this.player.play(samples);
      }
    } catch (error) {
      this.fail(`speech: ${error.message || error}`);
    }
  }

  finish(reason, usage) {
    this.reason = reason;
    if (usage) this.usage = usage;
  }

  refused(answer) {
    this.fail(describe(answer), message(answer));
    return null;
  }

  fail(detail, summary) {
    this.root.classList.add("error");
    this.root.append(h("pre", { class: "error-detail", text: detail }));
    if (summary) this.root.dataset.error = summary;
  }

  done() {
    this.root.classList.remove("pending");
    for (const [id, pcm] of this.streams) {
      if (!pcm.frames) continue;
      this.speech.append(
        h("div", { class: "said", text: this.said ? `said: ${this.said}` : "" }),
        h("audio", { controls: true, src: URL.createObjectURL(pcm.wav()), "data-audio-id": id }),
      );
    }
    const facts = [];
    if (this.firstText !== null) facts.push(`first text ${this.firstText} ms`);
    if (this.firstAudio !== null) facts.push(`first audio ${this.firstAudio} ms`);
    const seconds = [...this.streams.values()].reduce((n, pcm) => n + pcm.seconds, 0);
    if (seconds) facts.push(`${seconds.toFixed(2)} s of speech`);
    facts.push(`done in ${this.since()} ms`);
    if (this.reason) facts.push(`finish: ${this.reason}`);
    if (this.usage) facts.push(`${this.usage.prompt_tokens} + ${this.usage.completion_tokens} tokens`);
    this.meta.textContent = facts.join(" · ");
    this.root.dataset.done = "true";
  }
}
