'use strict';
/**
 * tablemail-nodemailer: a Nodemailer transport that writes each mail as a row
 * of tablemail's queue (`mail_queue`, and its files in `mail_attachment`) on
 * the application's own PostgreSQL connection or transaction (DESIGN §17).
 * Nothing is sent from here: the tablemail daemon sends what committed.
 *
 *     const transporter = nodemailer.createTransport(tablemailTransport({ query: (sql, params) => client.query(sql, params) }));
 *
 * A mail and its files go in one INSERT statement, so they commit together
 * even on a connection in autocommit. What the daemon would refuse (no
 * recipient, a reserved header, a line break in a header) is refused here,
 * before anything is written. Column names come from fixed lists; every
 * value is a query parameter.
 */

const crypto = require('crypto');
const url = require('url');
const pkg = require('./package.json');

/** The daemon's list (src/mail/header.rs), plus every Resent-*. */
const RESERVED_HEADERS = new Set([
    'from',
    'to',
    'cc',
    'bcc',
    'reply-to',
    'subject',
    'message-id',
    'date',
    'mime-version',
    'content-type',
    'content-transfer-encoding',
    'sender',
    'return-path',
    'received',
    'dkim-signature'
]);

/** Headers the daemon writes as they are (never encoded): printable ASCII. */
const STRUCTURED_HEADERS = new Set([
    'in-reply-to',
    'references',
    'auto-submitted',
    'archived-at',
    'content-language',
    'content-disposition',
    'content-id',
    'precedence',
    'feedback-id',
    'autocrypt'
]);

const MAX_EXTRA_HEADERS = 100;
const MAX_HEADERS_JSON = 64 * 1024;
const MAX_HEADER_NAME = 76;
const MAX_MESSAGE_ID = 250;
const MAX_CONTENT_ID = 250;
const MAX_FILENAME = 1024;

/** Nodemailer's priority as the `priority` column. */
const PRIORITIES = { high: 10, normal: 0, low: -10 };

/** The headers Nodemailer's own transports add for a priority. */
const PRIORITY_HEADERS = {
    high: [
        ['X-Priority', '1 (Highest)'],
        ['X-Msmail-Priority', 'High'],
        ['Importance', 'High']
    ],
    low: [
        ['X-Priority', '5 (Lowest)'],
        ['X-Msmail-Priority', 'Low'],
        ['Importance', 'Low']
    ]
};

/** Message fields tablemail cannot carry: refused rather than dropped. */
const UNSUPPORTED = {
    raw: 'a raw message cannot be a row',
    envelope: 'the envelope comes from to, cc and bcc',
    sender: 'Sender is reserved: it would change the envelope',
    alternatives: 'only text and html bodies are sent',
    icalEvent: 'only text and html bodies are sent',
    amp: 'only text and html bodies are sent',
    watchHtml: 'only text and html bodies are sent',
    list: 'set List-* headers in headers',
    date: 'the daemon dates the mail when it sends it',
    dkim: 'the daemon signs with its own DKIM settings'
};

/** `tablemail: {…}` keys and their columns, with the type each takes. */
const OPTIONS = {
    priority: ['priority', 'integer'],
    sendAt: ['send_at', 'date'],
    dedupeKey: ['dedupe_key', 'string'],
    bypassSuppression: ['bypass_suppression', 'boolean'],
    route: ['route', 'string'],
    template: ['template', 'string'],
    templateData: ['template_data', 'object'],
    locale: ['locale', 'string']
};

const ATEXT = /^[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+$/;
const TOKEN = /^[!#$%&'*+.^_`|~0-9A-Za-z-]+$/;
// eslint-disable-next-line no-control-regex
const CONTROL = /[\x00-\x08\x0a-\x1f\x7f\x80-\x9f]/;

/** An error of invalid input, with Nodemailer's codes. */
function invalid(message, code) {
    const err = new Error(message);
    err.code = code || 'EMESSAGE';
    return err;
}

function dotAtom(text) {
    return !!text && text.split('.').every(atom => ATEXT.test(atom));
}

/** Refuses CR, LF and NUL (a header injection) and the other controls but TAB. */
function checkText(what, value) {
    if (/[\r\n\0]/.test(value)) {
        throw invalid(`${what} may not contain CR, LF or NUL (a header injection)`);
    }
    if (CONTROL.test(value)) {
        throw invalid(`${what} may not contain control characters`);
    }
}

function checkMessageId(value) {
    checkText('messageId', value);
    const inner = /^<(.*)>$/.exec(value);
    const at = inner ? inner[1].indexOf('@') : -1;
    const left = at >= 0 ? inner[1].slice(0, at) : '';
    const right = at >= 0 ? inner[1].slice(at + 1) : '';
    const literal = /^\[[!-Z^-~]+\]$/.test(right);
    // eslint-disable-next-line no-control-regex
    if (value.length > MAX_MESSAGE_ID || /[^\x00-\x7f]/.test(value) || !dotAtom(left) || !(literal || dotAtom(right))) {
        throw invalid(`messageId ${JSON.stringify(value)} is not <id@domain>`);
    }
}

function checkContentId(value) {
    let cid = String(value).trim();
    if (cid.startsWith('<') && cid.endsWith('>')) {
        cid = cid.slice(1, -1);
    }
    const halves = cid.split('@');
    if (!cid || cid.length > MAX_CONTENT_ID || halves.length > 2 || !halves.every(dotAtom)) {
        throw invalid(`cid ${JSON.stringify(String(value))} is not a valid id (letters, digits, dots, one '@')`);
    }
    return cid;
}

/** Addresses as Nodemailer parsed them ({name, address}, groups flattened). */
function mailboxes(list, what) {
    const out = [];
    for (const entry of [].concat(list || [])) {
        if (!entry) {
            continue;
        }
        if (Array.isArray(entry.group)) {
            out.push(...mailboxes(entry.group, what));
            continue;
        }
        const name = String(entry.name || '');
        const address = String(entry.address || '');
        checkText(what, name + address);
        const at = address.lastIndexOf('@');
        if (at <= 0 || at === address.length - 1 || /\s/.test(address)) {
            throw invalid(`${what}: invalid address ${JSON.stringify(address)}`);
        }
        out.push({ name: name.trim(), address });
    }
    return out;
}

/** A comma-separated address column; names always quoted. */
function addressColumn(list) {
    if (!list.length) {
        return null;
    }
    return list.map(m => (m.name ? `"${m.name.replace(/[\\"]/g, '\\$&')}" <${m.address}>` : m.address)).join(', ');
}

/** The caller's `headers` (an object, or a list of {key, value}) as pairs. */
function headerPairs(headers) {
    const pairs = [];
    const one = (key, value) => {
        const values = [].concat(value === undefined || value === null ? [] : value);
        if (values.length > 1) {
            throw invalid(`header "${key}" is given ${values.length} times: tablemail takes one value per header`);
        }
        if (values.length === 1) {
            let v = values[0];
            if (v && typeof v === 'object' && 'value' in v) {
                v = v.value;
            }
            pairs.push([String(key), String(v)]);
        }
    };
    if (Array.isArray(headers)) {
        headers.forEach(h => one(h.key, h.value));
    } else if (headers && typeof headers === 'object') {
        Object.keys(headers).forEach(k => one(k, headers[k]));
    }
    return pairs;
}

/** Extra headers as the `headers` column (JSON), checked as the daemon checks them. */
function headersColumn(pairs) {
    if (!pairs.length) {
        return null;
    }
    if (pairs.length > MAX_EXTRA_HEADERS) {
        throw invalid(`at most ${MAX_EXTRA_HEADERS} extra headers, not ${pairs.length}`);
    }
    const out = {};
    const seen = new Set();
    for (const [name, value] of pairs) {
        if (!name || name.length > MAX_HEADER_NAME) {
            throw invalid(`header "${name.slice(0, 80)}": a name is 1 to ${MAX_HEADER_NAME} characters`);
        }
        if (!/^[!-9;-~]+$/.test(name)) {
            throw invalid(`header ${JSON.stringify(name)}: a name is printable ASCII without ':', spaces or line breaks`);
        }
        const lower = name.toLowerCase();
        if (RESERVED_HEADERS.has(lower) || lower.startsWith('resent-')) {
            throw invalid(
                `header "${name}" is reserved by tablemail: it is set from the mail's fields or would change the envelope or the trace`
            );
        }
        if (seen.has(lower)) {
            throw invalid(`header "${name}" is given twice`);
        }
        seen.add(lower);
        checkText(`header "${name}"`, value);
        if ((lower.startsWith('list-') || STRUCTURED_HEADERS.has(lower)) && !/^[\t -~]*$/.test(value)) {
            throw invalid(`header "${name}" is structured: printable ASCII only`);
        }
        out[name] = value;
    }
    const json = JSON.stringify(out);
    if (Buffer.byteLength(json) > MAX_HEADERS_JSON) {
        throw invalid(`the extra headers are over ${MAX_HEADERS_JSON} octets as JSON`);
    }
    return json;
}

/** `<id>` for In-Reply-To, `<a> <b>` for References, as Nodemailer writes them. */
function msgIds(what, value) {
    const ids = [];
    for (const entry of [].concat(value || [])) {
        checkText(what, String(entry));
        for (let id of String(entry).trim().split(/\s+/)) {
            if (id) {
                ids.push((id.startsWith('<') ? '' : '<') + id + (id.endsWith('>') ? '' : '>'));
            }
        }
    }
    return ids.join(' ');
}

/** A body or an attachment's content, resolved by Nodemailer, as a Buffer. */
function contentBuffer(node, encoding) {
    const content = node && typeof node === 'object' && !Buffer.isBuffer(node) ? node.content : node;
    if (content === undefined || content === null || content === false) {
        return null;
    }
    if (Buffer.isBuffer(content)) {
        return content;
    }
    if (content instanceof Uint8Array) {
        return Buffer.from(content.buffer, content.byteOffset, content.byteLength);
    }
    return Buffer.from(String(content), encoding || 'utf8');
}

/** `type/subtype; params`, without `name` (the daemon writes it from the filename). */
function contentType(value, textString) {
    const parts = String(value).split(';');
    const essence = parts.shift().trim().toLowerCase();
    const [kind, subtype] = essence.split('/');
    if (!TOKEN.test(kind || '') || !TOKEN.test(subtype || '') || essence.split('/').length !== 2) {
        throw invalid(`${JSON.stringify(String(value))} is not a content type (type/subtype)`);
    }
    if (kind === 'multipart' || kind === 'message') {
        throw invalid(`tablemail cannot attach ${essence} (it may not be base64-encoded); attach it as application/octet-stream`);
    }
    const params = [];
    let charset = false;
    for (const part of parts) {
        const eq = part.indexOf('=');
        const key = part.slice(0, eq).trim();
        let val = part.slice(eq + 1).trim();
        if (eq < 0 || !key) {
            continue;
        }
        if (/^name\*?/i.test(key)) {
            continue;
        }
        if (val.startsWith('"') && val.endsWith('"') && val.length > 1) {
            val = val.slice(1, -1);
        }
        if (!TOKEN.test(key) || !/^[ -~]*$/.test(val)) {
            throw invalid(`content type parameter ${key} is not printable ASCII`);
        }
        charset = charset || key.toLowerCase() === 'charset';
        params.push(TOKEN.test(val) ? `${key}=${val}` : `${key}="${val.replace(/[\\"]/g, '\\$&')}"`);
    }
    // Nodemailer gives text from a string its charset, as here.
    if (kind === 'text' && textString && !charset) {
        params.push('charset=utf-8');
    }
    return [essence, ...params].join('; ');
}

function checkOptions(options) {
    if (options === undefined || options === null) {
        return {};
    }
    if (typeof options !== 'object' || Array.isArray(options)) {
        throw invalid('tablemail must be an object');
    }
    const out = {};
    for (const key of Object.keys(options)) {
        const value = options[key];
        if (!Object.prototype.hasOwnProperty.call(OPTIONS, key)) {
            throw invalid(`tablemail has an unknown key ${JSON.stringify(key)} (known: ${Object.keys(OPTIONS).join(', ')})`);
        }
        if (value === undefined || value === null) {
            continue;
        }
        const [column, type] = OPTIONS[key];
        let ok;
        switch (type) {
            case 'integer':
                ok = Number.isInteger(value) && value >= -(2 ** 31) && value < 2 ** 31;
                break;
            case 'date':
                ok = value instanceof Date && !isNaN(value.getTime());
                break;
            case 'object':
                ok = typeof value === 'object' && !Array.isArray(value);
                break;
            default:
                ok = typeof value === type;
        }
        if (!ok) {
            throw invalid(`tablemail.${key} must be ${type === 'date' ? 'a valid Date' : `a ${type}`}`);
        }
        out[column] = type === 'date' ? value.toISOString() : type === 'object' ? JSON.stringify(value) : value;
    }
    return out;
}

/** Nodemailer's priority: `high`, `normal` or `low`. */
function priorityOf(value) {
    if (value === undefined || value === null || value === '') {
        return null;
    }
    const key = String(value).toLowerCase();
    if (!Object.prototype.hasOwnProperty.call(PRIORITIES, key)) {
        throw invalid(`priority must be high, normal or low, not ${JSON.stringify(String(value))}`);
    }
    return key;
}

/** A new Message-ID: the sender's domain as A-labels, else localhost. */
function newMessageId(fromAddress) {
    let domain = 'localhost';
    if (fromAddress) {
        const candidate = url.domainToASCII(fromAddress.slice(fromAddress.lastIndexOf('@') + 1));
        if (dotAtom(candidate)) {
            domain = candidate;
        }
    }
    return `<${crypto.randomUUID()}@${domain}>`;
}

/**
 * The row of a mail as Nodemailer compiled it (`mail.data` resolved by
 * `mail.resolveAll`): `{ columns: [[name, value, cast]], attachments, messageId, envelope }`.
 * Throws for what tablemail would refuse.
 */
function rowOf(data, messageIdHint) {
    // The caller's headers first: Nodemailer reads a Sender header into `sender`.
    const pairs = headerPairs(data.headers);
    headersColumn(pairs);
    for (const key of Object.keys(UNSUPPORTED)) {
        if (data[key] !== undefined && data[key] !== null && data[key] !== false) {
            throw invalid(`tablemail cannot send "${key}": ${UNSUPPORTED[key]}`);
        }
    }
    const from = mailboxes(data.from, 'from');
    if (from.length > 1) {
        throw invalid('from has more than one address');
    }
    const to = mailboxes(data.to, 'to');
    const cc = mailboxes(data.cc, 'cc');
    const bcc = mailboxes(data.bcc, 'bcc');
    const replyTo = mailboxes(data.replyTo, 'replyTo');
    if (!to.length && !cc.length && !bcc.length) {
        throw invalid('No recipients defined (to, cc or bcc)', 'EENVELOPE');
    }
    const subject = data.subject === undefined || data.subject === null ? '' : String(data.subject);
    checkText('subject', subject);

    if (data.inReplyTo) {
        pairs.push(['In-Reply-To', msgIds('inReplyTo', data.inReplyTo)]);
    }
    if (data.references) {
        pairs.push(['References', msgIds('references', data.references)]);
    }
    const priority = priorityOf(data.priority);
    if (priority && PRIORITY_HEADERS[priority]) {
        pairs.push(...PRIORITY_HEADERS[priority]);
    }
    if (data.xMailer) {
        pairs.push(['X-Mailer', String(data.xMailer)]);
    }
    const headers = headersColumn(pairs);

    const messageId = messageIdHint || newMessageId(from.length ? from[0].address : null);
    checkMessageId(messageId);

    const text = contentBuffer(data.text);
    const html = contentBuffer(data.html);
    const attachments = (data.attachments || []).map((a, i) => {
        const number = i + 1;
        if (a.raw) {
            throw invalid(`attachment ${number}: a raw attachment cannot be a row`);
        }
        if (a.headers && Object.keys(a.headers).length) {
            throw invalid(`attachment ${number}: tablemail writes a file's headers itself`);
        }
        const filename = String(a.filename || `attachment-${number}.bin`);
        checkText(`attachment ${number} filename`, filename);
        if (!filename.trim() || Buffer.byteLength(filename) > MAX_FILENAME) {
            throw invalid(`attachment ${number}: a filename is 1 to ${MAX_FILENAME} octets`);
        }
        const textString = typeof a.content === 'string' && !a.encoding;
        const content = contentBuffer(a, a.encoding) || Buffer.alloc(0);
        return {
            filename,
            contentType: contentType(a.contentType || 'application/octet-stream', textString),
            content,
            contentId: a.cid ? checkContentId(a.cid) : null
        };
    });

    const options = checkOptions(data.tablemail);
    const columns = [
        ['to_address', addressColumn(to) || ''],
        ['subject', subject],
        ['message_id', messageId]
    ];
    const optional = [
        ['cc', addressColumn(cc)],
        ['bcc', addressColumn(bcc)],
        ['reply_to', addressColumn(replyTo)],
        // An empty name, not NULL: the daemon's defaults.from_name would fill NULL.
        ['from_name', from.length ? from[0].name : null],
        ['from_address', from.length ? from[0].address : null],
        ['body', text ? text.toString('utf8') : null],
        ['body_html', html ? html.toString('utf8') : null],
        ['headers', headers, 'jsonb'],
        ['priority', priority ? PRIORITIES[priority] : null]
    ];
    for (const [name, value, cast] of optional) {
        if (value !== null) {
            columns.push([name, value, cast]);
        }
    }
    for (const [column, value] of Object.entries(options)) {
        const at = columns.findIndex(c => c[0] === column);
        const cast = column === 'send_at' ? 'timestamptz' : column === 'template_data' ? 'jsonb' : null;
        if (at >= 0) {
            columns[at] = [column, value, cast];
        } else {
            columns.push([column, value, cast]);
        }
    }
    for (const [, value] of columns) {
        if (typeof value === 'string') {
            // PostgreSQL text cannot hold NUL; say so before the database does.
            if (value.includes('\0')) {
                throw invalid('a text field contains NUL');
            }
        }
    }
    const envelope = {
        from: from.length ? from[0].address : false,
        to: [...new Set([...to, ...cc, ...bcc].map(m => m.address))]
    };
    return { columns, attachments, messageId, envelope, dedupeKey: options.dedupe_key };
}

/** One INSERT of the mail and its files, and its parameters. */
function insertStatement(row) {
    const params = [];
    const param = (value, cast) => {
        params.push(value);
        return `$${params.length}` + (cast ? `::${cast}` : '');
    };
    const names = row.columns.map(c => c[0]);
    const marks = row.columns.map(([, value, cast]) => param(value, cast));
    let sql = `WITH mail AS (INSERT INTO mail_queue (${names.join(', ')}) VALUES (${marks.join(', ')})`;
    if (row.dedupeKey !== undefined) {
        sql += ' ON CONFLICT (dedupe_key) DO NOTHING';
    }
    sql += ' RETURNING id)';
    if (row.attachments.length) {
        const values = row.attachments.map(
            (a, i) =>
                `(${param(a.filename, 'text')}, ${param(a.contentType, 'text')}, ${param(a.content, 'bytea')}, ${param(a.contentId, 'text')}, ${i})`
        );
        // In the given order: the daemon sends files in id order.
        sql +=
            ', parts AS (INSERT INTO mail_attachment (mail_id, filename, content_type, content, content_id)' +
            ' SELECT mail.id, f.filename, f.content_type, f.content, f.content_id' +
            ` FROM mail, (VALUES ${values.join(', ')}) AS f(filename, content_type, content, content_id, n)` +
            ' ORDER BY f.n)';
    }
    sql += ' SELECT id FROM mail';
    return { sql, params };
}

/** Nodemailer's MIME helpers, from the application's own Nodemailer. */
function mimeFuncs() {
    try {
        return require('nodemailer/lib/mime-funcs');
    } catch (e) {
        return {
            detectMimeType: () => 'application/octet-stream',
            detectExtension: () => 'bin'
        };
    }
}

/**
 * Gives each attachment the type and file name Nodemailer's own transports
 * give it (MailComposer's rules), before `resolveAll` fills in names by
 * rules of its own.
 */
function nameAttachments(attachments) {
    if (!Array.isArray(attachments) || !attachments.length) {
        return;
    }
    const funcs = mimeFuncs();
    attachments.forEach((a, i) => {
        if (!a || typeof a !== 'object') {
            return;
        }
        const source = a.path || a.href || '';
        if (!a.contentType) {
            const dataUrl = /^data:([^;,]+)/i.exec(typeof source === 'string' ? source : '');
            a.contentType = dataUrl ? dataUrl[1] : funcs.detectMimeType(a.filename || source || 'bin');
        }
        if (!a.filename) {
            let name = typeof source === 'string' && !/^data:/i.test(source) ? source.split(/[/\\]/).pop().split('?').shift() : '';
            name = name || `attachment-${i + 1}`;
            if (name.indexOf('.') < 0) {
                name += '.' + funcs.detectExtension(a.contentType);
            }
            a.filename = name;
        }
    });
}

/**
 * The Message-ID the row stores: the caller's `messageId` (checked), else the
 * one Nodemailer gave the message when it is valid for the daemon, else a
 * new one.
 */
function messageIdOf(mail, data) {
    if (data.messageId) {
        const id = String(data.messageId).trim();
        return (id.startsWith('<') ? '' : '<') + id + (id.endsWith('>') ? '' : '>');
    }
    const generated = mail.message && typeof mail.message.messageId === 'function' ? mail.message.messageId() : null;
    if (generated) {
        try {
            checkMessageId(String(generated));
            return String(generated);
        } catch (e) {
            // An internationalized domain, say: a new one below.
        }
    }
    return null;
}

function rowsOf(result) {
    if (Array.isArray(result)) {
        return result;
    }
    return (result && result.rows) || [];
}

function idOf(value) {
    const n = Number(value);
    return Number.isSafeInteger(n) ? n : String(value);
}

/**
 * The transport. `options.query(sql, params)` runs a statement on the
 * application's connection (a pg `Client`, `Pool` or transaction client)
 * and resolves to its result (`{ rows }`).
 */
function tablemailTransport(options) {
    const query = options && options.query;
    if (typeof query !== 'function') {
        throw new TypeError('tablemailTransport needs { query: (sql, params) => client.query(sql, params) }');
    }
    return {
        name: 'tablemail',
        version: pkg.version,

        send(mail, callback) {
            nameAttachments(mail.data.attachments);
            mail.resolveAll((err, data) => {
                if (err) {
                    return callback(err);
                }
                let row;
                try {
                    row = rowOf(data, messageIdOf(mail, data));
                } catch (e) {
                    return callback(e);
                }
                const { sql, params } = insertStatement(row);
                Promise.resolve()
                    .then(() => query(sql, params))
                    .then(async result => {
                        const inserted = rowsOf(result);
                        if (inserted.length) {
                            return { id: inserted[0].id, messageId: row.messageId, duplicate: false };
                        }
                        // The dedupe key was taken: nothing was written, the mail exists.
                        const existing = rowsOf(
                            await query('SELECT id, message_id FROM mail_queue WHERE dedupe_key = $1', [row.dedupeKey])
                        );
                        if (!existing.length) {
                            throw new Error('tablemail: the INSERT returned no row');
                        }
                        return { id: existing[0].id, messageId: existing[0].message_id || row.messageId, duplicate: true };
                    })
                    .then(
                        ({ id, messageId, duplicate }) =>
                            callback(null, {
                                envelope: row.envelope,
                                messageId,
                                tablemailId: idOf(id),
                                duplicate,
                                accepted: row.envelope.to.slice(),
                                rejected: [],
                                pending: [],
                                response: `queued as mail_queue row ${id}`
                            }),
                        callback
                    );
            });
        },

        /** `transporter.verify()`: the queue table is there and readable. */
        verify(callback) {
            const done = typeof callback === 'function' ? callback : null;
            const run = Promise.resolve()
                .then(() => query('SELECT id FROM mail_queue LIMIT 0', []))
                .then(() => true);
            if (done) {
                run.then(ok => done(null, ok), done);
                return undefined;
            }
            return run;
        }
    };
}

module.exports = tablemailTransport;
module.exports.tablemailTransport = tablemailTransport;
module.exports.default = tablemailTransport;
module.exports.RESERVED_HEADERS = RESERVED_HEADERS;
