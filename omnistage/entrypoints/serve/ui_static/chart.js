// A small line chart in SVG: memory over time, one line per series.
import { bytes, s } from "./dom.js";

const WIDTH = 320;
const HEIGHT = 110;
const PAD = { left: 58, right: 6, top: 6, bottom: 16 };

// series: [{label, color, dashed, points: [[t (ms), value], ...]}]; window_ms: the time shown.
export function lineChart(series, windowMs, now = Date.now()) {
  const max = Math.max(1, ...series.flatMap((line) => line.points.map(([, v]) => v)));
  const x = (t) => PAD.left + ((t - (now - windowMs)) / windowMs) * (WIDTH - PAD.left - PAD.right);
  const y = (v) => HEIGHT - PAD.bottom - (v / max) * (HEIGHT - PAD.top - PAD.bottom);
  const svg = s("svg", {
    viewBox: `0 0 ${WIDTH} ${HEIGHT}`,
    class: "chart",
    role: "img",
    "aria-label": series.map((line) => line.label).join(", "),
  });
  for (const value of [0, max / 2, max]) {
    svg.append(
      s("line", { x1: PAD.left, x2: WIDTH - PAD.right, y1: y(value), y2: y(value), class: "grid" }),
      s("text", { x: PAD.left - 4, y: y(value) + 3, class: "axis", "text-anchor": "end" }, bytes(value)),
    );
  }
  svg.append(
    s("text", { x: PAD.left, y: HEIGHT - 3, class: "axis" }, `-${Math.round(windowMs / 1000)} s`),
    s("text", { x: WIDTH - PAD.right, y: HEIGHT - 3, class: "axis", "text-anchor": "end" }, "now"),
  );
  for (const line of series) {
    const visible = line.points.filter(([t]) => t >= now - windowMs);
    if (!visible.length) continue;
    // A step line: memory changes at a sample and holds until the next one.
    const steps = [];
    visible.forEach(([t, v], i) => {
      if (i) steps.push(`${x(t).toFixed(1)},${y(visible[i - 1][1]).toFixed(1)}`);
      steps.push(`${x(t).toFixed(1)},${y(v).toFixed(1)}`);
    });
    steps.push(`${x(now).toFixed(1)},${y(visible[visible.length - 1][1]).toFixed(1)}`);
    svg.append(
      s("polyline", {
        points: steps.join(" "),
        class: line.dashed ? "series dashed" : "series",
        stroke: line.color,
      }),
    );
  }
  return svg;
}
