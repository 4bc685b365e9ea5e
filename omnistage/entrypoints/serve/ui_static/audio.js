// Speech in a streamed reply, played as it arrives: OpenAI's delta.audio pieces (base64 of a
// WAV whose header comes first, or of raw pcm16) decoded piece by piece and scheduled back to
// back with the Web Audio API at the audio's own sample rate; and WAV encoding for what the
// user records or attaches.

export const PCM16_RATE = 24000; // OpenAI's pcm16: 24 kHz, mono, 16-bit little-endian
const INPUT_RATE = 16000; // what a recording is sent at (speech encoders take 16 kHz)

function decodeBase64(text) {
  const binary = atob(text);
  const out = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i += 1) out[i] = binary.charCodeAt(i);
  return out;
}

function concat(a, b) {
  if (!a.length) return b;
  const out = new Uint8Array(a.length + b.length);
  out.set(a);
  out.set(b, a.length);
  return out;
}

function tag(bytes, at) {
  return String.fromCharCode(bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]);
}

// One audio of a reply (one delta.audio id). push(base64 piece) gives the samples it
// completes, {rate, channels, data: Float32Array per channel}, or null while a header or a
// sample is still partial. Pieces may split the base64 text or the bytes anywhere.
export class PcmStream {
  constructor(format) {
    this.format = format;
    this.text = ""; // base64 characters not decoded yet (a piece cut inside a quantum)
    this.pending = new Uint8Array(0); // bytes not turned into samples yet
    this.ready = format === "pcm16";
    this.rate = this.ready ? PCM16_RATE : 0;
    this.channels = 1;
    this.left = Infinity; // data bytes still to come (a WAV's data size, unless "unknown")
    this.pcm = []; // every sample's bytes, for the replay
    this.frames = 0;
  }

  push(piece) {
    this.text += piece.replace(/\s+/g, "");
    const usable = this.text.includes("=") ? this.text.length : this.text.length - (this.text.length % 4);
    if (usable) {
      this.pending = concat(this.pending, decodeBase64(this.text.slice(0, usable)));
      this.text = this.text.slice(usable);
    }
    if (!this.ready && !this.header()) return null;
    const frameBytes = 2 * this.channels;
    let take = Math.min(this.pending.length, this.left);
    take -= take % frameBytes;
    if (!take) return null;
    const chunk = this.pending.slice(0, take);
    this.pending = this.pending.slice(take);
    this.left -= take;
    this.pcm.push(chunk);
    const view = new DataView(chunk.buffer);
    const frames = take / frameBytes;
    const data = Array.from({ length: this.channels }, () => new Float32Array(frames));
    for (let f = 0; f < frames; f += 1) {
      for (let c = 0; c < this.channels; c += 1) {
        data[c][f] = view.getInt16((f * this.channels + c) * 2, true) / 32768;
      }
    }
    this.frames += frames;
    return { rate: this.rate, channels: this.channels, data };
  }

  // Reads the RIFF header once its bytes are there; throws on what is not 16-bit PCM WAV.
  header() {
    const b = this.pending;
    if (b.length < 12) return false;
    if (tag(b, 0) !== "RIFF" || tag(b, 8) !== "WAVE") throw new Error("the audio is not a WAV stream");
    const view = new DataView(b.buffer, b.byteOffset, b.byteLength);
    let at = 12;
    while (at + 8 <= b.length) {
      const id = tag(b, at);
      const size = view.getUint32(at + 4, true);
      if (id === "data") {
        this.ready = true;
        this.left = size === 0 || size === 0xffffffff ? Infinity : size;
        this.pending = b.slice(at + 8);
        if (!this.rate) throw new Error("the WAV stream has no fmt chunk before its data");
        return true;
      }
      if (at + 8 + size > b.length) return false;
      if (id === "fmt ") {
        const encoding = view.getUint16(at + 8, true);
        const bits = view.getUint16(at + 22, true);
        if (encoding !== 1 || bits !== 16) throw new Error(`WAV of ${bits}-bit encoding ${encoding}: only 16-bit PCM plays here`);
        this.channels = view.getUint16(at + 10, true);
        this.rate = view.getUint32(at + 12, true);
      }
      at += 8 + size + (size % 2);
    }
    return false;
  }

  get seconds() {
    return this.rate ? this.frames / this.rate : 0;
  }

  // The whole audio so far as a WAV file (for an <audio> element to replay).
  wav() {
    const total = this.pcm.reduce((n, c) => n + c.length, 0);
    const out = new Uint8Array(44 + total);
    out.set(wavHeader(total, this.rate || PCM16_RATE, this.channels));
    let at = 44;
    for (const chunk of this.pcm) {
      out.set(chunk, at);
      at += chunk.length;
    }
    return new Blob([out], { type: "audio/wav" });
  }
}

function wavHeader(dataBytes, rate, channels) {
  const header = new DataView(new ArrayBuffer(44));
  const text = (at, value) => [...value].forEach((ch, i) => header.setUint8(at + i, ch.charCodeAt(0)));
  text(0, "RIFF");
  header.setUint32(4, 36 + dataBytes, true);
  text(8, "WAVE");
  text(12, "fmt ");
  header.setUint32(16, 16, true);
  header.setUint16(20, 1, true);
  header.setUint16(22, channels, true);
  header.setUint32(24, rate, true);
  header.setUint32(28, rate * channels * 2, true);
  header.setUint16(32, channels * 2, true);
  header.setUint16(34, 16, true);
  text(36, "data");
  header.setUint32(40, dataBytes, true);
  return new Uint8Array(header.buffer);
}

// Mono float samples as a 16-bit PCM WAV file's bytes.
export function encodeWav(samples, rate) {
  const out = new Uint8Array(44 + samples.length * 2);
  out.set(wavHeader(samples.length * 2, rate, 1));
  const view = new DataView(out.buffer);
  for (let i = 0; i < samples.length; i += 1) {
    const v = Math.max(-1, Math.min(1, samples[i]));
    view.setInt16(44 + i * 2, Math.round(v * 32767), true);
  }
  return out;
}

// Any audio the browser can decode (a recording's WebM/Opus, an attached file) as a mono
// 16 kHz WAV: the browser resamples, the channels are averaged.
export async function toWav(arrayBuffer) {
  const decoded = await new OfflineAudioContext(1, 1, INPUT_RATE).decodeAudioData(arrayBuffer);
  const mono = new Float32Array(decoded.length);
  for (let c = 0; c < decoded.numberOfChannels; c += 1) {
    const data = decoded.getChannelData(c);
    for (let i = 0; i < data.length; i += 1) mono[i] += data[i] / decoded.numberOfChannels;
  }
  return encodeWav(mono, decoded.sampleRate);
}

// Plays decoded pieces back to back, each as soon as it arrives.
export class StreamPlayer {
  constructor() {
    this.context = null;
    this.until = 0;
    this.sources = new Set();
  }

  // From a user's gesture (the Send button): browsers start audio only after one.
  unlock() {
    if (!this.context) this.context = new AudioContext();
    if (this.context.state === "suspended") this.context.resume();
  }

  play(samples) {
    if (!this.context || !samples || !samples.data[0].length) return;
    const buffer = this.context.createBuffer(samples.channels, samples.data[0].length, samples.rate);
    samples.data.forEach((data, c) => buffer.copyToChannel(data, c));
    const source = this.context.createBufferSource();
    source.buffer = buffer;
    source.connect(this.context.destination);
    const start = Math.max(this.until, this.context.currentTime + 0.05);
    source.start(start);
    this.until = start + buffer.duration;
    this.sources.add(source);
    source.onended = () => this.sources.delete(source);
  }

  stop() {
    for (const source of this.sources) source.stop();
    this.sources.clear();
    this.until = 0;
  }
}

const SLICE_MS = 250; // a recording's data arrives in pieces this long

// A microphone recording (MediaRecorder); stop() gives the recorded Blob.
export class Recorder {
  static get available() {
    return Boolean(navigator.mediaDevices && navigator.mediaDevices.getUserMedia && window.MediaRecorder);
  }

  async start() {
    this.stream = await navigator.mediaDevices.getUserMedia({ audio: true });
    this.recorder = new MediaRecorder(this.stream);
    this.parts = [];
    this.recorder.ondataavailable = (event) => {
      if (event.data.size) this.parts.push(event.data);
      this.onpart(this.parts.length * (SLICE_MS / 1000));
    };
    this.recorder.start(SLICE_MS);
  }

  onpart() {} // (seconds recorded so far)

  stop() {
    return new Promise((resolve) => {
      this.recorder.onstop = () => {
        for (const track of this.stream.getTracks()) track.stop();
        resolve(new Blob(this.parts, { type: this.recorder.mimeType }));
      };
      this.recorder.stop();
    });
  }
}
