// Types for tablemail-nodemailer: a Nodemailer transport that writes rows of
// tablemail's queue on the application's own pg connection or transaction.

declare function tablemailTransport(options: tablemailTransport.Options): tablemailTransport.Transport;

declare namespace tablemailTransport {
    /** Runs one statement on the application's connection: `(sql, params) => client.query(sql, params)`. */
    type Query = (sql: string, params: unknown[]) => Promise<{ rows: any[] } | any[]>;

    interface Options {
        query: Query;
    }

    /** `tablemail: {…}` on a message: the columns Nodemailer has no field for. */
    interface MessageOptions {
        priority?: number;
        sendAt?: Date;
        dedupeKey?: string;
        bypassSuppression?: boolean;
        route?: string;
        template?: string;
        templateData?: Record<string, unknown>;
        locale?: string;
    }

    interface SentMessageInfo {
        envelope: { from: string | false; to: string[] };
        /** The Message-ID stored in the row, the one the daemon sends. */
        messageId: string;
        /** The row's `mail_queue.id`. */
        tablemailId: number;
        /** The dedupe key was taken: nothing was written, the ids are the existing row's. */
        duplicate: boolean;
        accepted: string[];
        rejected: string[];
        pending: string[];
        response: string;
    }

    interface Transport {
        name: 'tablemail';
        version: string;
        send(mail: any, callback: (err: Error | null, info?: SentMessageInfo) => void): void;
        verify(callback?: (err: Error | null, ok?: boolean) => void): Promise<boolean> | undefined;
    }

    const RESERVED_HEADERS: Set<string>;
    export { tablemailTransport, tablemailTransport as default };
}

export = tablemailTransport;
